"""Which host a process runs on: the identity that decides "same node, use the local path".

The kernel's boot id (``/proc/sys/kernel/random/boot_id``) is the same for every
process of one booted kernel, whatever its PID, mount or network namespace, and
differs between machines and across reboots. That is what decides whether a source's
Unix socket and its memory can be reached. In Kubernetes, pods on one node already
share the boot id; ``MX_NODE_NAME`` (set from the downward API's ``spec.nodeName``)
replaces it where an operator prefers a readable name, or where test hosts share one
kernel but must not count as one node.

The hostname is not used: every pod has its own.
"""

from __future__ import annotations

import pathlib

from modelexpress.errors import ConfigError

__all__ = ["BOOT_ID_PATH", "host_id", "same_host"]

BOOT_ID_PATH = pathlib.Path("/proc/sys/kernel/random/boot_id")


def host_id(node_name: str | None = None, boot_id_path: pathlib.Path = BOOT_ID_PATH) -> str:
    """This host's identity: ``"node:<name>"`` or ``"boot:<kernel boot id>"``.

    Args:
        node_name: ``MxSettings.node_name`` (``MX_NODE_NAME``); empty or None means the
            boot id.
        boot_id_path: where the kernel publishes the boot id (tests pass another file).

    Returns:
        A string that is equal for two processes exactly when they share a node.

    Raises:
        ConfigError: no node name and the boot id cannot be read (not Linux).
    """
    if node_name:
        return f"node:{node_name.strip()}"
    try:
        boot = boot_id_path.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read the kernel boot id at {boot_id_path} ({exc}); set "
                          "MX_NODE_NAME to this node's name") from exc
    if not boot:
        raise ConfigError(f"{boot_id_path} is empty; set MX_NODE_NAME to this node's name")
    return f"boot:{boot}"


def same_host(peer_host_id: str | None, node_name: str | None = None) -> bool:
    """Whether a peer that published ``peer_host_id`` runs on this host."""
    if not peer_host_id:
        return False
    try:
        return peer_host_id == host_id(node_name)
    except ConfigError:
        return False
