"""bench/cluster.py runs end to end (--quick) and reports every measurement it names.

Rates are not asserted (benchmarks measure; tests check behaviour).
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from netns_cluster import PREFIX, require_netns

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent


def test_cluster_bench_quick_reports_striping_fanout_relay_and_zero_and_leaves_nothing(
        tmp_path: pathlib.Path) -> None:
    require_netns()
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "cluster.py"), "--quick",
                             "--workdir", str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    out, err = proc.communicate(timeout=540)
    assert proc.returncode == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    stripe = result["striping_uniform"]
    for key in ("single", "stripe_2", "stripe_2_capped_target"):
        assert stripe[key]["transport"] == "tcp", key
        assert stripe[key]["mbit"] > 0 and stripe[key]["ratio"] > 0, key
    assert stripe["stripe_2"]["sources"] == 2
    assert stripe["stripe_2"]["shares"] == [0.5, 0.5]  # 96 equal tensors, split evenly
    fan = result["fanout"]["2"]
    for mode in ("one_source", "serve_spread_together", "serve_spread_waves"):
        assert fan[mode]["last_s"] > 0 and len(fan[mode]["timeline"]) == 2, mode
    assert fan["one_source"]["from_first_source"] == 2
    relay = result["relay"]["uniform"]
    assert relay["1"]["paths"] == [1] and relay["2"]["paths"] == [1, 2]  # a chain of two
    assert relay["2"]["last_s"] > 0 and relay["2"]["vs_one"] > 0
    split = relay["2"]["cpu_s"]  # where the CPU of the window went, [user, system]
    assert set(split) == {"server", "origin", "bench", "softirq", "agents", "busiest_agent"}
    assert sum(split["agents"]) > 0 and sum(split["server"]) > 0, split
    assert relay["2"]["origin_tx_bytes_per_packet"] > 0
    zero = result["zero"]  # from zero: storage on a host of its own, no source anywhere
    assert zero["1"]["roles"] == ["origin"] and zero["2"]["roles"] == ["follower", "origin"]
    for n in ("1", "2"):
        assert zero[n]["verified"] and zero[n]["storage_copies"] <= 1.01, zero[n]
    assert zero["2"]["vs_one"] > 0
    owner = f"{PREFIX}{proc.pid % (1 << 24):06x}"
    left = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    left += subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert owner not in left
