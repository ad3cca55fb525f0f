"""The VMM arena: one reserved virtual range that a worker's weights live in.

See ``modelexpress/vmm/README.md``. Nothing here imports torch or cuda-python at
import time; the C extension (``_alloc_ext``, no dependencies) is imported to set
``ARENA_AVAILABLE``.
"""

from modelexpress.vmm.arena import DEFAULT_TOTAL_BYTES, VmmArena, VmmBackend
from modelexpress.vmm.backend import CudaVmmBackend, cuda_vmm_supported
from modelexpress.vmm.hook import ARENA_AVAILABLE, use_arena
from modelexpress.vmm.host import HostVmmBackend
from modelexpress.vmm.runtime import arena_unavailable_reason, maybe_enter_vmm_arena
from modelexpress.vmm.stub import StubVmmBackend

__all__ = [
    "ARENA_AVAILABLE",
    "DEFAULT_TOTAL_BYTES",
    "CudaVmmBackend",
    "HostVmmBackend",
    "StubVmmBackend",
    "VmmArena",
    "VmmBackend",
    "arena_unavailable_reason",
    "cuda_vmm_supported",
    "maybe_enter_vmm_arena",
    "use_arena",
]
