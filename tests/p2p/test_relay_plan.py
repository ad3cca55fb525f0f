"""The relay planner (pure): chains while the fleet is small against the chunk count,
trees beyond, reader limits, link awareness, fallback paths ending at a complete holder."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from modelexpress.p2p.relay_plan import (HOP_CHUNKS, MIN_PIECE_BYTES, Holder, assign,
                                         choose_fanout, parse_ref, piece_bytes, predicted_t1,
                                         source_ref, tensor_chunks, transfer_ref)

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent


def _claim_all(n: int, fanout: int, origin_mbit: float = 0.0, downlink: float = 0.0):
    origin = source_ref("o")
    holders = [Holder(origin, True, uplink_mbit=origin_mbit)]
    readers: dict[str, int] = {}
    out = []
    for i in range(n):
        live = [Holder(h.ref, h.complete, readers.get(h.ref, 0), h.path, h.uplink_mbit)
                for h in holders]
        a = assign(live, fanout=fanout, downlink_mbit=downlink)
        readers[a.upstream] = readers.get(a.upstream, 0) + 1
        holders.append(Holder(transfer_ref(str(i)), False, path=a.path))
        out.append(a)
    return out


def test_one_reader_per_holder_builds_a_chain_whose_paths_end_at_the_origin() -> None:
    plan = _claim_all(4, fanout=1)
    assert [a.upstream for a in plan] == ["s:o", "t:0", "t:1", "t:2"]
    assert plan[3].path == ("t:2", "t:1", "t:0", "s:o")
    assert all(not a.saturated for a in plan)


def test_two_readers_per_holder_fill_the_shallowest_level_first_in_turn() -> None:
    plan = _claim_all(7, fanout=2)
    assert [a.upstream for a in plan] == ["s:o", "s:o", "t:0", "t:1", "t:0", "t:1", "t:2"]


def test_a_complete_holder_with_a_free_slot_is_taken_before_a_relay() -> None:
    holders = [Holder("s:o", True, readers=1), Holder("t:a", False, path=("s:o",)),
               Holder("s:b", True, readers=0)]
    assert assign(holders, fanout=1).upstream == "s:b"


def test_a_saturated_fleet_over_subscribes_the_least_loaded_holder() -> None:
    holders = [Holder("s:o", True, readers=3), Holder("s:p", True, readers=1)]
    a = assign(holders, fanout=1)
    assert a.saturated and a.upstream == "s:p"


def test_a_fast_origin_serves_as_many_chains_as_its_uplink_fits() -> None:
    plan = _claim_all(8, fanout=1, origin_mbit=100_000, downlink=25_000)
    assert sum(a.upstream == "s:o" for a in plan) == 4


def test_the_fanout_is_a_chain_until_the_fleet_outgrows_the_chunk_count() -> None:
    assert choose_fanout(8, chunks=44) == 1
    assert choose_fanout(1000, chunks=44) > 1
    assert predicted_t1(8, 44, 1, hop_chunks=1) == pytest.approx(1 + 7 / 44)
    assert predicted_t1(8, 44, 1) == pytest.approx(1 + 7 * HOP_CHUNKS / 44)
    # a binary tree of 20 is 4 deep: 2 x (1 + 3 h / 44) against a chain's 1 + 19 h / 44
    assert predicted_t1(20, 44, 2) == pytest.approx(2 * (1 + 3 * HOP_CHUNKS / 44))


def test_a_hop_that_lags_longer_turns_the_chain_into_a_tree_sooner() -> None:
    assert choose_fanout(20, chunks=44, hop_chunks=1) == 1
    assert choose_fanout(20, chunks=44) == 2  # the measured hop (HOP_CHUNKS)


def test_relay_pieces_follow_the_models_size_and_a_known_links_speed() -> None:
    most = 4 << 20
    # a 91 MB model: the largest power of two within 1/128 of it
    assert piece_bytes(90_856_704, most) == 512 << 10
    # a small model: never under the floor; a large one: never over the setting
    assert piece_bytes(3 << 20, most) == MIN_PIECE_BYTES
    assert piece_bytes(16 << 30, most) == most
    assert piece_bytes(512 << 20, most) == most and piece_bytes((512 << 20) - 1, most) == 2 << 20
    # a fast link: 5 ms of it (100 Gbit/s: 62.5 MB, capped at the setting; 1 Gbit/s: 625 kB)
    assert piece_bytes(90_856_704, most, link_mbit=100_000) == most
    assert piece_bytes(90_856_704, most, link_mbit=1000) == 625_000
    assert piece_bytes(90_856_704, most, link_mbit=100) == 512 << 10  # the model's share
    # a smaller setting wins over both
    assert piece_bytes(16 << 30, 64 << 10, link_mbit=100_000) == 64 << 10
    with pytest.raises(ValueError, match="most"):
        piece_bytes(1 << 20, 0)


def test_tensor_chunks_are_whole_tensors_and_a_large_tensor_is_its_own_chunk() -> None:
    assert tensor_chunks([1, 1, 1, 10, 1], 2) == [(0, 2, 2), (2, 4, 13), (4, 5, 14)]
    assert tensor_chunks([], 4) == []
    with pytest.raises(ValueError, match="chunk_bytes"):
        tensor_chunks([1], 0)


def test_refs_parse_and_bad_ones_say_what_is_allowed() -> None:
    assert parse_ref("t:abc") == ("transfer", "abc")
    assert parse_ref("s:x:y") == ("source", "x:y")
    with pytest.raises(ValueError, match="s:<source id>"):
        parse_ref("x")


def test_fleet_sim_prints_a_row_per_fleet_size_and_the_origin_sends_one_copy_in_a_chain(
        ) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "fleet_sim.py"), "--n", "1,8,200",
                          "--fail", "0"], capture_output=True, text=True, timeout=120, check=True)
    rows = json.loads(out.stdout.strip().splitlines()[-1])["rows"]
    assert [r["n"] for r in rows] == [1, 8, 200]
    assert rows[1]["fanout"] == 1 and rows[1]["origin_models"] == pytest.approx(1.0)
    assert all(r["last_s"] is not None for r in rows)
