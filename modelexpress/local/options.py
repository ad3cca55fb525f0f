"""LocalOptions: what the local transport takes from MxSettings, built once at an entry point."""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

from modelexpress.local.hostid import host_id

if TYPE_CHECKING:
    from modelexpress.settings import MxSettings

__all__ = ["LocalOptions", "DEFAULT_IPC_DIR"]

DEFAULT_IPC_DIR = "/dev/shm/modelexpress"


@dataclasses.dataclass(frozen=True)
class LocalOptions:
    """Settings of the local transport.

    Attributes:
        ipc_dir: where sources put their sockets (``MX_IPC_DIR``; shared by every
            process of the node: a hostPath volume in Kubernetes).
        node_name: ``MX_NODE_NAME`` or "" (then the kernel boot id identifies the host).
        enabled: False turns the local transport off (``MX_IPC_DIR`` set to "off").
        huge_pages: ``auto``, ``on`` or ``off``: a host pull's new destination memory in
            transparent huge pages (``MX_LOCAL_HUGE_PAGES``; :mod:`.hugepages`).
    """

    ipc_dir: str = DEFAULT_IPC_DIR
    node_name: str = ""
    huge_pages: str = "auto"

    @property
    def enabled(self) -> bool:
        return self.ipc_dir not in ("", "off")

    @property
    def host_id(self) -> str:
        """This process's host identity (see :func:`~modelexpress.local.hostid.host_id`)."""
        return host_id(self.node_name or None)

    @classmethod
    def from_settings(cls, settings: "MxSettings") -> LocalOptions:
        """Read ``MX_IPC_DIR``, ``MX_NODE_NAME`` and ``MX_LOCAL_HUGE_PAGES`` (through
        MxSettings)."""
        return cls(ipc_dir=os.path.expanduser(settings.ipc_dir),
                   node_name=settings.node_name or "", huge_pages=settings.local_huge_pages)
