"""The relay reader's pieces (modelexpress/p2p/relay.py): large tensors cut, the
advertised prefix held back until a tensor verified, a bad tensor forgotten whole."""

from __future__ import annotations

import pytest
import torch

from modelexpress.errors import IntegrityError
from modelexpress.p2p.relay import _Pieces
from modelexpress.transfer.digest import digest
from modelexpress.transfer.manifest import Manifest, tensor_entry

_ALGO = "wsum-i32-v1"


def _origin(src: dict[str, torch.Tensor]) -> Manifest:
    return Manifest(agent_name="origin", host="h", digest_algorithm=_ALGO,
                    tensors=tuple(tensor_entry(n, t, digest(t, _ALGO)) for n, t in src.items()))


def _fill(pieces: _Pieces, src: dict[str, torch.Tensor], key: str) -> None:
    name, off, n = pieces.spans[key]
    pieces.views[key].copy_(src[name].reshape(-1).view(torch.uint8)[off:off + n])


def test_a_large_tensor_is_cut_and_the_prefix_passes_it_only_once_verified() -> None:
    src = {"small": torch.arange(4, dtype=torch.float32),            # 16 bytes
           "big": torch.arange(10, dtype=torch.float32) + 1}         # 40 bytes, 3 pieces
    dest = {n: torch.zeros_like(t) for n, t in src.items()}
    pieces = _Pieces(_origin(src), dest, chunk_bytes=16, verify=True)
    assert pieces.keys == ["small@0", "big@0", "big@16", "big@32"]
    assert pieces.ends == [16, 32, 48, 56] and pieces.total == 56
    assert list(pieces.below(32)) == ["small@0", "big@0"]
    for key in pieces.keys[:3]:
        _fill(pieces, src, key)
    assert pieces.landed("small@0") == 16
    assert pieces.landed("big@0") == 32   # landed pieces of the tensor in progress count
    assert pieces.landed("big@16") == 48
    _fill(pieces, src, "big@32")
    assert pieces.landed("big@32") == 56 and pieces.complete
    assert all(torch.equal(dest[n], src[n]) for n in src)


def test_a_tensor_that_completes_with_bad_bytes_is_refused_and_read_again_whole() -> None:
    src = {"big": torch.arange(8, dtype=torch.float32)}
    dest = {"big": torch.zeros(8)}
    pieces = _Pieces(_origin(src), dest, chunk_bytes=16, verify=True)
    _fill(pieces, src, "big@0")
    pieces.landed("big@0")
    pieces.views["big@16"].fill_(7)  # a holder served garbage for the second piece
    with pytest.raises(IntegrityError, match="'big'.*origin"):
        pieces.landed("big@16")
    assert not pieces.complete
    assert list(pieces.below(32)) == ["big@0", "big@16"]  # both pieces again, from elsewhere


def test_a_failed_read_forgets_the_pieces_of_tensors_not_verified() -> None:
    src = {"a": torch.ones(4), "b": torch.ones(8)}
    dest = {n: torch.zeros_like(t) for n, t in src.items()}
    pieces = _Pieces(_origin(src), dest, chunk_bytes=16, verify=True)
    for key in ("a@0", "b@0"):
        _fill(pieces, src, key)
        pieces.landed(key)
    pieces.forget_unverified()
    assert list(pieces.below(48)) == ["b@0", "b@16"]  # 'a' is kept: it verified
