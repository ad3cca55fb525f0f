"""Outputs are complete or absent: a checkpoint written by `pull --out` (save_checkpoint)
appears under its name only when every shard is on disk, with the user's umask, and an
existing output is refused unless overwrite. The writers here are real processes that
are killed or interrupted while writing."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch

from modelexpress.checkpoint import load_checkpoint, save_checkpoint
from modelexpress.errors import OutputError, OutputExistsError

# A child that writes 8 shards of 32 MiB, pausing 0.3 s after each, so that a signal
# sent once the first shard is on disk lands mid-write even on a fast, idle machine.
_WRITER = """
import os, signal, sys, time, torch
# A child of a background job starts with SIGINT ignored (the shell's rule for '&'), and
# Python then installs no KeyboardInterrupt handler: restore it, as in a terminal.
signal.signal(signal.SIGINT, signal.default_int_handler)
import safetensors.torch as st
from modelexpress.checkpoint import save_checkpoint
_save = st.save_file
def _slow_save(*args, **kwargs):
    _save(*args, **kwargs)
    time.sleep(0.3)
st.save_file = _slow_save
os.umask(int(sys.argv[2], 8))
tensors = {f"t{i}": torch.full((8 << 20,), i, dtype=torch.float32) for i in range(8)}
save_checkpoint(tensors, sys.argv[1], shard_bytes=32 << 20)
print("done", flush=True)
"""


def _writer(out: pathlib.Path, umask: str = "022") -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", _WRITER, str(out), umask],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_for_a_partial_shard(parent: pathlib.Path, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        partial = [p for d in parent.glob(".out.partial-*") for p in d.iterdir()]
        if partial:
            return
        assert proc.poll() is None, f"the writer exited early: {proc.communicate()}"
        time.sleep(0.005)
    raise AssertionError("no shard appeared in a partial directory within 120 s")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT, signal.SIGTERM],
                         ids=["SIGKILL", "SIGINT", "SIGTERM"])
def test_a_writer_stopped_mid_write_leaves_no_file_with_the_final_name(
        tmp_path: pathlib.Path, sig: int) -> None:
    proc = _writer(tmp_path / "out")
    try:
        _wait_for_a_partial_shard(tmp_path, proc)
        proc.send_signal(sig)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert proc.returncode != 0
    assert not (tmp_path / "out").exists()
    left = [p.name for p in tmp_path.iterdir()]
    if sig == signal.SIGKILL:  # no cleanup can run; what is left never looks complete
        assert all(name.startswith(".out.partial-") for name in left), left
    elif sig == signal.SIGINT:  # KeyboardInterrupt: the partial directory is removed
        assert left == []


@pytest.mark.parametrize(("umask", "file_mode", "dir_mode"),
                         [("022", 0o644, 0o755), ("077", 0o600, 0o700), ("002", 0o664, 0o775)])
def test_written_checkpoints_follow_the_umask(tmp_path: pathlib.Path, umask: str,
                                              file_mode: int, dir_mode: int) -> None:
    proc = _writer(tmp_path / "out", umask)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and out.strip() == b"done", err[-2000:]
    files = sorted((tmp_path / "out").iterdir())
    assert [f.name for f in files] == [f"model-{i:05d}-of-00008.safetensors"
                                       for i in range(1, 9)]
    assert {f.stat().st_mode & 0o777 for f in files} == {file_mode}
    assert (tmp_path / "out").stat().st_mode & 0o777 == dir_mode
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_an_existing_output_is_refused_unless_overwrite(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "out"
    save_checkpoint({"a": torch.arange(4)}, out)
    with pytest.raises(OutputExistsError, match="already exists and is not empty; pass "
                                                "--overwrite"):
        save_checkpoint({"b": torch.arange(3)}, out)
    assert list(load_checkpoint(out)) == ["a"]
    save_checkpoint({"b": torch.arange(3)}, out, overwrite=True)
    assert list(load_checkpoint(out)) == ["b"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # the old one is gone
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputExistsError, match="is not a directory"):
        save_checkpoint({"a": torch.arange(4)}, tmp_path / "file")
    with pytest.raises(OutputError, match="is not a directory"):
        save_checkpoint({"a": torch.arange(4)}, tmp_path / "file", overwrite=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    save_checkpoint({"a": torch.arange(4)}, empty)  # an empty directory is not "existing"
    assert list(load_checkpoint(empty)) == ["a"]


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_full_disk_leaves_neither_the_final_nor_a_temporary_name(
        tmp_path: pathlib.Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], check=True,
                   timeout=30)
    try:
        with pytest.raises(OutputError, match="No space left on device") as info:
            save_checkpoint({"a": torch.zeros(1 << 16)}, mnt / "out")
        assert info.value.errno == 28
        assert list(mnt.iterdir()) == []
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, timeout=30)


@pytest.mark.skipif(os.geteuid() != 0, reason="drops to nobody to make a directory unlistable")
def test_an_unlistable_checkpoint_directory_is_named_not_reported_empty(
        tmp_path: pathlib.Path) -> None:
    # glob() on a directory one may not list returns nothing: the error would read
    # "holds no *.safetensors file". The library says what is wrong instead.
    import shutil
    import tempfile

    work = pathlib.Path(tempfile.mkdtemp(prefix="mx-unlistable-"))  # nobody may enter it
    os.chmod(work, 0o755)
    ckpt = work / "ckpt"
    save_checkpoint({"a": torch.arange(4)}, ckpt)
    os.chmod(ckpt, 0o311)
    code = ("from modelexpress.checkpoint import checkpoint_files as f\n"
            "try:\n    f(%r)\nexcept Exception as e:\n    print(type(e).__name__, e)\n" % str(ckpt))
    out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                          sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "HOME": str(tmp_path)})
    shutil.rmtree(work)
    assert out.stdout.strip() == (f"CheckpointError cannot read checkpoint {ckpt}: "
                                  "Permission denied"), out.stderr[-2000:]
