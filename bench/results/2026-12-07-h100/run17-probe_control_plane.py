"""Where the control plane's time goes in a pull across layouts and a same-layout pull.

Run from the repository root: ``python3 bench/results/2026-12-07-h100/run17-probe_control_plane.py
DEVICE`` (``cpu`` or ``cuda:0``). Three synthetic sources (TP=1 and both TP=2 ranks, the
8B-width layer of ``tests/p2p/synthetic_layout.py``) on DEVICE and a real server; 12 pulls
of each case into DEVICE, alternating, the first untimed; prints the medians of the
phases and of each control-plane request (timed in ``MxClient._request``), and of
``_fetch``, ``Layout.from_json``, ``manifest_of`` and ``plan_layout``.
"""
import os, sys, time, pathlib, tempfile, statistics, collections
sys.path[:0] = ["tests/p2p", "tests/server"]
os.environ.setdefault("LAYOUT_SYNTHETIC_DIMS", "4096,1024,14336,32000")
import torch
import synthetic_layout as syn
from layout_world import layout_sources
from modelexpress.client import MxClient
from modelexpress.local import LocalOptions
from modelexpress.p2p import PullOptions, pull
from modelexpress.p2p.layout_pull import pull_across_layouts

DEV = sys.argv[1] if len(sys.argv) > 1 else "cpu"
calls = collections.defaultdict(list)
class C(MxClient):
    def _request(self, method, path, *a, **k):
        t0=time.perf_counter()
        try: return super()._request(method, path, *a, **k)
        finally: calls[(cur[0], method, path.split('/')[2] if path.count('/')>1 else path, path.split('/')[-1] if path.count('/')>3 else '')].append(time.perf_counter()-t0)
cur=[None]
import modelexpress.p2p.layout_pull as lp
import modelexpress.p2p.manifests as mf
from modelexpress.layout import Layout
def timed(name, fn):
    def w(*a, **k):
        t0=time.perf_counter()
        try: return fn(*a, **k)
        finally: calls[(cur[0], name, '', '')].append(time.perf_counter()-t0)
    return w
lp._fetch = timed("_fetch", lp._fetch)
mf.manifest_of = timed("manifest_of", mf.manifest_of)
_fj = Layout.from_json.__func__
Layout.from_json = classmethod(timed("Layout.from_json", _fj))
lp.plan_layout = timed("plan_layout", lp.plan_layout)
work = pathlib.Path(tempfile.mkdtemp())
commands = {n: ["synthetic_source", str(tp), str(r), DEV, n] for n, tp, r in (("r0",2,0),("r1",2,1),("whole",1,0))}
with layout_sources(work, commands, pythonpath="tests/p2p", ready_s=300) as (server, ipc, ids):
    c = C(server.url, token=server.token, timeout_s=30)
    opts = PullOptions(local=LocalOptions(ipc_dir=ipc), worker_id="probe", stall_s=60)
    tot = collections.defaultdict(list); phases=collections.defaultdict(list)
    for i in range(12):
        for case in ("same","across"):
            target = syn.layout(1,0)
            dest = {n: torch.zeros(s, dtype=d, device=DEV) for n,s,d in syn.specs(target)}
            cur[0] = case if i else "warm"
            t0=time.perf_counter()
            if case=="same":
                r = pull(syn.identity(1,0), dest, client=c, options=opts)
            else:
                r = pull_across_layouts(syn.identity(1,0), target, dest, client=c, options=opts).result
            if i:
                tot[case].append(time.perf_counter()-t0); phases[case].append(r.phases)
    for case in tot:
        print(case, "total %.2f ms" % (statistics.median(tot[case])*1e3), {k: round(statistics.median([p.get(k, 0) for p in phases[case]])*1e3, 2) for k in phases[case][0]})
    for k,v in sorted(calls.items(), key=lambda kv: str(kv[0])):
        if k[0]=="warm": continue
        print(k, len(v), "median %.2f ms sum/pull %.2f ms" % (statistics.median(v)*1e3, sum(v)/11*1e3))
