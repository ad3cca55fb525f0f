"""The local transport without its C copy loop (``_copyloop`` not built): the Python loop
copies the same pieces, every byte lands and is verified, and the process says so once."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

from .conftest import ROOT

WITHOUT = ROOT / "tests" / "without.py"
HERE = pathlib.Path(__file__).parent

# A fresh target process: the extension hidden before anything imports modelexpress,
# two pulls from the same source (the warning is once per process, not per pull).
TARGET = r"""
import json, logging, sys
sys.path.insert(0, sys.argv[1])
info_path, seed, mib = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])

class Keep(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())

keep = Keep()
logging.getLogger("modelexpress").addHandler(keep)

import torch
from _peers import make_tensors
from modelexpress.local import LocalEndpoint, pull
from modelexpress.local import hostcopy
from modelexpress.transfer.manifest import Manifest

with open(info_path) as f:
    info = json.load(f)
endpoint = LocalEndpoint.from_json(info["endpoint"])
manifest = Manifest.from_json(info["manifest"])
want = make_tensors(seed, mib)
out = {"native": hostcopy.NATIVE, "loaded": "modelexpress.local._copyloop" in sys.modules,
       "pulls": []}
for _ in range(2):
    dst = {t.name: torch.empty(t.shape, dtype=getattr(torch, t.dtype)) for t in manifest.tensors}
    res = pull(endpoint, manifest, dst, deadline_s=120)
    out["pulls"].append({
        "nbytes": res.nbytes, "verified": res.verified, "tensors": len(manifest.tensors),
        "transport": res.transport,
        "equal": all(torch.equal(want[k].view(torch.uint8), dst[k].view(torch.uint8))
                     for k in want)})
out["warnings"] = keep.messages
print(json.dumps(out), flush=True)
"""


def test_a_pull_without_the_c_copy_loop_copies_in_python_and_warns_once(make_source):
    mib = 24
    src = make_source("buffer", mib=mib)
    proc = subprocess.run(
        [sys.executable, str(WITHOUT), "modelexpress.local._copyloop", "-c", TARGET,
         str(HERE), str(src.info_path), str(src.seed), str(mib)],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["native"] is False and out["loaded"] is False  # the extension really was absent
    for one in out["pulls"]:
        assert one["transport"] == "local"
        assert one["nbytes"] == sum(t.numel() * t.element_size()
                                    for t in _tensors(src.seed, mib).values())
        assert one["verified"] == one["tensors"] and one["equal"], one
    about = [m for m in out["warnings"] if "modelexpress.local._copyloop" in m]
    assert len(about) == 1, out["warnings"]
    assert "Python threads" in about[0] and "C compiler" in about[0]
    assert len(out["warnings"]) == 1, out["warnings"]  # and nothing else went wrong


def _tensors(seed: int, mib: int):  # type: ignore[no-untyped-def]
    from ._peers import make_tensors
    return make_tensors(seed, mib)
