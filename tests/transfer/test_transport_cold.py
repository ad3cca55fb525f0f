"""The transport verdict does not mistake a new peer's connection setup for a fallback."""

from __future__ import annotations


def test_a_cold_first_chunk_is_not_read_as_a_fallback() -> None:
    from modelexpress.transfer import assess
    from modelexpress.transfer.transport import COLD_FLOOR_GBPS

    # Recorded on an H200 host: a fresh agent's first 64 MiB over cuda_ipc (IPC
    # handles opened) ran at 5.6 GB/s; VMM memory over the TCP fallback at 0.48 GB/s.
    mib64 = 64 << 20
    assert not assess("cuda_ipc", mib64, mib64 / 5.6e9).ok          # steady: far too slow
    assert assess("cuda_ipc", mib64, mib64 / 5.6e9, cold=True).ok    # cold start: fine
    assert not assess("cuda_ipc", mib64, mib64 / 0.48e9, cold=True).ok
    assert 0.52 < COLD_FLOOR_GBPS < 5.6
