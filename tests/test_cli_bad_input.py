"""Every command with the inputs users get wrong: one clear line, a documented exit code.

Each row runs the real ``modelexpress`` console script of this venv in a subprocess
and asserts its exit code (the table in ``modelexpress/_cli_support.py`` and
docs/DEPLOYMENT.md, "Exit codes"), that stderr's last non-empty line names the
problem, and that there is no traceback unless ``--debug``. The control plane is a
real uvicorn server; the source a real ``modelexpress publish`` serving MiniLM over
NIXL. Full and read-only output directories are tiny tmpfs mounts (root only).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Iterator

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "server"))
from mx_server_procs import TOKEN, ServerProc, free_port  # noqa: E402

from modelexpress._subproc import ModuleProcess, clean_env  # noqa: E402
from modelexpress.checkpoint import real_model_checkpoint  # noqa: E402

MODELEXPRESS = str(pathlib.Path(sys.executable).parent / "modelexpress")
MODEL = "sentence-transformers/all-MiniLM-L6-v2"
IS_ROOT = os.geteuid() == 0
DEAD_SERVER = "http://127.0.0.1:9"  # discard port: nothing listens there


@dataclasses.dataclass
class Ran:
    code: int
    stdout: str
    stderr: str

    @property
    def last_line(self) -> str:
        lines = [ln for ln in self.stderr.splitlines() if ln.strip()]
        return lines[-1] if lines else ""


def run(args: list[str], env: dict[str, str] | None = None, timeout: float = 180,
        user: int | None = None) -> Ran:
    """``modelexpress ARGS`` in a fresh process (as ``user`` when given; needs root)."""
    cmd = [MODELEXPRESS, *args]
    if user is not None:
        cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=clean_env(MX_CLIENT_RETRIES="0", **(env or {})))
    return Ran(proc.returncode, proc.stdout, proc.stderr)


def assert_fails(ran: Ran, code: int, names: str | tuple[str, ...],
                 debug: bool = False) -> None:
    detail = f"exit {ran.code}\nstdout:\n{ran.stdout[-2000:]}\nstderr:\n{ran.stderr[-3000:]}"
    assert ran.code == code, detail
    assert ran.last_line.startswith("error: "), detail
    for part in (names,) if isinstance(names, str) else names:
        assert part in ran.last_line, detail
    assert ("Traceback" in ran.stderr) == debug, detail
    assert "╭" not in ran.stderr, detail  # no framed rich traceback or error box


# --- bad files ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def files() -> Iterator[pathlib.Path]:
    """Checkpoints users get wrong, in a directory others can read (the ``nobody`` row)."""
    import torch
    from safetensors.torch import save_file

    root = pathlib.Path(tempfile.mkdtemp(prefix="mx-bad-input-"))
    os.chmod(root, 0o755)
    good = (real_model_checkpoint() / "model.safetensors").read_bytes()
    for name, data in (("empty", b""), ("truncated", good[: len(good) // 2]),
                       ("text", b"this is a README, not weights\n" * 10)):
        (root / name).mkdir()
        (root / name / "model.safetensors").write_bytes(data)
    (root / "nofiles").mkdir()
    (root / "model.bin").write_bytes(b"\x80\x02}q\x00.")  # a pickle, as torch.save wrote
    (root / "dup").mkdir()
    save_file({"a": torch.zeros(2), "shared.weight": torch.ones(3)},
              str(root / "dup" / "model-00001-of-00002.safetensors"))
    save_file({"shared.weight": torch.ones(3)},
              str(root / "dup" / "model-00002-of-00002.safetensors"))
    (root / "locked").mkdir(mode=0o755)
    save_file({"a": torch.zeros(2)}, str(root / "locked" / "model.safetensors"))
    os.chmod(root / "locked" / "model.safetensors", 0o000)
    (root / "lockeddir").mkdir()
    save_file({"a": torch.zeros(2)}, str(root / "lockeddir" / "model.safetensors"))
    for d in root.iterdir():
        if d.is_dir():
            os.chmod(d, 0o755)
    os.chmod(root / "lockeddir", 0o311)  # others may enter, not list
    yield root
    shutil.rmtree(root, ignore_errors=True)


PUBLISH_ROWS = [
    # (checkpoint under `files`, exit code, what the last line names)
    ("missing", 2, "does not exist"),
    ("nofiles", 2, "holds no *.safetensors file"),
    ("empty", 2, "(0 bytes) is empty"),
    ("truncated", 2, "truncated or not a safetensors file"),
    ("text", 2, "truncated or not a safetensors file"),
    ("model.bin", 2, "is not a *.safetensors file"),
    ("dup", 2, "'shared.weight' appears in both"),
]


@pytest.mark.parametrize(("checkpoint", "code", "names"), PUBLISH_ROWS,
                         ids=[r[0] for r in PUBLISH_ROWS])
def test_publish_bad_checkpoint(files: pathlib.Path, checkpoint: str, code: int,
                                names: str) -> None:
    ran = run(["publish", str(files / checkpoint), "--model", "m", "--server", DEAD_SERVER])
    assert_fails(ran, code, names)
    assert str(files / checkpoint) in ran.last_line  # which input


def test_publish_bad_checkpoint_with_debug_shows_the_traceback_then_the_line(
        files: pathlib.Path) -> None:
    ran = run(["publish", str(files / "truncated"), "--model", "m", "--debug"])
    assert_fails(ran, 2, "truncated or not a safetensors file", debug=True)
    ran = run(["publish", str(files / "truncated"), "--model", "m"],
              env={"MX_LOG_LEVEL": "DEBUG"})
    assert_fails(ran, 2, "truncated or not a safetensors file", debug=True)


@pytest.mark.skipif(not IS_ROOT, reason="runs the command as nobody (setpriv needs root)")
@pytest.mark.parametrize(("checkpoint", "named", "why"), [
    ("locked", "locked/model.safetensors", "Permission denied"),  # our check
    ("lockeddir", "lockeddir", "is not readable"),  # the CLI's argument check, first
])
def test_publish_unreadable_checkpoint(files: pathlib.Path, checkpoint: str, named: str,
                                       why: str) -> None:
    ran = run(["publish", str(files / checkpoint), "--model", "m"], user=65534,
              env={"HOME": str(files)})
    assert_fails(ran, 2, (why, f"{files / named}"))


# --- usage, settings, the server's own flags -------------------------------------------

USAGE_ROWS = [
    (["pull", "--out", "x"], {}, 2, "Missing option '--model'"),
    (["pull", "--model", "m", "--out", "x", "--tp", "two"], {}, 2, "Invalid value for '--tp'"),
    (["frobnicate"], {}, 2, "No such command 'frobnicate'"),
    # a bad setting: which flag or variable, its value, what is accepted
    (["sources", "list"], {"MX_SOURCE_POLICY": "nearest"}, 2,
     ("MX_SOURCE_POLICY", "'nearest'", "random, spread")),
    (["sources", "list"], {"MX_TRANSFER_TIMEOUT_S": "soon"}, 2,
     ("MX_TRANSFER_TIMEOUT_S", "'soon'")),
    (["serve", "--store", "mysql://x"], {}, 2, ("--store", "'mysql://x'", "sqlite:///PATH",
                                                "redis://HOST:PORT/DB")),
    (["serve"], {"MX_STORE": "postgres://db"}, 2, ("MX_STORE", "'postgres://db'", "sqlite:///")),
    (["serve", "--port", "70000"], {}, 2, ("--port", "70000", "65535")),
    (["transfers", "start", "--target", "a"], {}, 2, "needs --identity ID or --model NAME"),
    (["pull", "--model", "m", "--out", "{tmp}/out", "--device", "gpu"], {}, 2,
     ("--device 'gpu' is not a device", "cpu or cuda:N")),
    (["agent", "--device", "cuda:99"], {}, 2, "--device cuda:99: this host has"),
    (["sources", "list", "--server", DEAD_SERVER], {}, 3, "unreachable"),
    (["transfers", "list", "--server", DEAD_SERVER], {}, 3, "is `modelexpress serve` running"),
    (["pull", "--model", "m", "--out", "{tmp}/out", "--server", DEAD_SERVER], {}, 3,
     "unreachable"),
    (["agent", "--server", DEAD_SERVER], {}, 3, "unreachable"),
]


@pytest.mark.parametrize(("args", "env", "code", "names"), USAGE_ROWS,
                         ids=[" ".join(r[0][:2]) + f"-{i}" for i, r in enumerate(USAGE_ROWS)])
def test_usage_settings_and_unreachable_server(tmp_path: pathlib.Path, args: list[str],
                                               env: dict[str, str], code: int,
                                               names: str) -> None:
    ran = run([a.replace("{tmp}", str(tmp_path)) for a in args], env=env)
    assert_fails(ran, code, names)
    assert not (tmp_path / "out").exists()


@pytest.mark.nixl
@pytest.mark.slow
def test_publish_to_a_server_that_is_down() -> None:
    ran = run(["publish", str(real_model_checkpoint()), "--model", "m", "--server",
               DEAD_SERVER])
    assert_fails(ran, 3, f"control plane at {DEAD_SERVER} unreachable")


def test_serve_on_a_port_in_use(tmp_path: pathlib.Path) -> None:
    import socket

    port = free_port()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        ran = run(["serve", "--host", "127.0.0.1", "--port", str(port), "--store",
                   f"sqlite:///{tmp_path / 'mx.db'}"])
    assert_fails(ran, 2, f"port {port} on 127.0.0.1 is in use")


def test_help_documents_the_exit_codes() -> None:
    for args in (["--help"], ["pull", "--help"], ["serve", "--help"]):
        ran = run(args)
        assert ran.code == 0 and "130 interrupted by SIGINT" in " ".join(ran.stdout.split())


# --- against a real server and source ----------------------------------------------------


@dataclasses.dataclass
class Live:
    server: ServerProc
    source: ModuleProcess
    workdir: pathlib.Path

    def env(self, **more: str) -> dict[str, str]:
        return {"MX_SERVER_URL": self.server.url, "MX_SERVER_TOKEN": TOKEN, **more}


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    """One token-protected server and one source for the rows below (starting a source
    costs tens of seconds here, so the rows share it; none of them changes it)."""
    work = pathlib.Path(tempfile.mkdtemp(prefix="mx-bad-input-live-"))
    os.chmod(work, 0o755)
    server = ServerProc(f"sqlite:///{work / 'mx.db'}", work).start()
    source = ModuleProcess(["modelexpress", "publish", str(real_model_checkpoint()), "--model",
                            MODEL, "--json"], work / "source.log",
                           clean_env(MX_SERVER_URL=server.url, MX_SERVER_TOKEN=TOKEN,
                                     MX_HEARTBEAT_INTERVAL_S="1"))
    try:
        source.json_line(180)
        yield Live(server, source, work)
    finally:
        code = source.stop()
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    assert code == 0, f"the source's SIGTERM is its normal end, exit 0; got {code}"


@pytest.mark.nixl
@pytest.mark.slow
def test_wrong_token_and_no_source(live: Live, tmp_path: pathlib.Path) -> None:
    ran = run(["sources", "list"], env=live.env(MX_SERVER_TOKEN="wrong"))
    assert_fails(ran, 3, "set MX_SERVER_TOKEN to the server's token")
    ran = run(["pull", "--model", "nobody/serves-this", "--out", str(tmp_path / "o")],
              env=live.env())
    assert_fails(ran, 4, "no READY source for nobody/serves-this")
    assert not (tmp_path / "o").exists()
    ran = run(["transfers", "get", "no-such-transfer"], env=live.env())
    assert_fails(ran, 1, "NotFoundError")


@pytest.mark.nixl
@pytest.mark.slow
def test_pull_refuses_an_existing_output_unless_overwrite(live: Live,
                                                          tmp_path: pathlib.Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    ran = run(["pull", "--model", MODEL, "--out", str(out)], env=live.env())
    assert_fails(ran, 2, f"output directory {out} already exists and is not empty; pass "
                         "--overwrite")
    assert (out / "notes.txt").read_text() == "mine"
    ran = run(["pull", "--model", MODEL, "--out", str(out), "--overwrite", "--json"],
              env=live.env())
    assert ran.code == 0, ran.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["model-00001-of-00001.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing left beside it
    mask = os.umask(0)
    os.umask(mask)
    assert (out / "model-00001-of-00001.safetensors").stat().st_mode & 0o777 == 0o666 & ~mask
    assert out.stat().st_mode & 0o777 == 0o777 & ~mask


@pytest.fixture
def tiny_mounts(tmp_path: pathlib.Path) -> Iterator[dict[str, pathlib.Path]]:
    """A 64 KiB tmpfs (full after the first shard) and a read-only one."""
    if not IS_ROOT:
        pytest.skip("mounting a tmpfs needs root")
    mounts = {"full": tmp_path / "full", "ro": tmp_path / "ro"}
    for name, path in mounts.items():
        path.mkdir()
        opts = "size=64k" + (",ro" if name == "ro" else "")
        subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], check=True,
                       timeout=30)
    try:
        yield mounts
    finally:
        for path in mounts.values():
            subprocess.run(["umount", "-l", str(path)], check=False, timeout=30)


@pytest.mark.nixl
@pytest.mark.slow
def test_pull_to_a_full_or_read_only_directory_leaves_nothing(
        live: Live, tiny_mounts: dict[str, pathlib.Path]) -> None:
    ran = run(["pull", "--model", MODEL, "--out", str(tiny_mounts["full"] / "model")],
              env=live.env())
    assert_fails(ran, 1, "No space left on device")
    assert str(tiny_mounts["full"] / "model") in ran.last_line
    assert list(tiny_mounts["full"].iterdir()) == []  # no final name, no temporary one
    ran = run(["pull", "--model", MODEL, "--out", str(tiny_mounts["ro"] / "model")],
              env=live.env())
    assert_fails(ran, 2, "Read-only file system")
    assert list(tiny_mounts["ro"].iterdir()) == []


def _wait_for(probe, what: str, deadline_s: float):  # noqa: ANN001,ANN202
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        value = probe()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {deadline_s} s waiting for {what}")


@pytest.mark.nixl
@pytest.mark.slow
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)],
                         ids=["SIGINT", "SIGTERM"])
def test_signal_midway_through_a_pull(live: Live, tmp_path: pathlib.Path, sig: int,
                                      code: int) -> None:
    from modelexpress.client import MxClient

    out = tmp_path / "out"
    # ~10 MB/s in 1 MiB chunks: the 90 MB pull runs for seconds, a stop lands midway
    env = clean_env(**live.env(MX_TRANSFER_MAX_GBPS="0.01", MX_TRANSFER_CHUNK_BYTES="1048576",
                               MX_CLIENT_RETRIES="0"))
    proc = subprocess.Popen([MODELEXPRESS, "pull", "--model", MODEL, "--out", str(out),
                             "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    with MxClient(live.server.url, token=TOKEN) as client:
        try:
            running = _wait_for(
                lambda: [t for t in client.list_transfers(state="RUNNING")
                         if 0 < t.bytes_done < t.bytes_total], "the pull to be midway", 180)
            proc.send_signal(sig)
            stdout, stderr = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=30)
        ran = Ran(proc.returncode, stdout, stderr)
        assert_fails(ran, code, f"interrupted by {signal.Signals(sig).name}: pull of {MODEL} "
                                f"stopped; nothing was written to {out}")
        assert not out.exists()
        assert list(tmp_path.iterdir()) == []
        final = _wait_for(lambda: client.get_transfer(running[0].id).state
                          in ("STOPPED", "FAILED") and client.get_transfer(running[0].id),
                          "the pull's record to end", 30)
        assert final.state == "STOPPED" and final.bytes_done < final.bytes_total


@pytest.mark.nixl
@pytest.mark.slow
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)],
                         ids=["SIGINT", "SIGTERM"])
def test_signal_midway_through_a_publish(live: Live, tmp_path: pathlib.Path, sig: int,
                                         code: int) -> None:
    """A signal before the source served ends publish with 130/143 and leaves no READY
    source behind; after it served, a signal is publish's normal end (the fixture)."""
    from modelexpress.client import MxClient

    log = tmp_path / "publish.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen([MODELEXPRESS, "publish", str(real_model_checkpoint()),
                                 "--model", "midway/publish", "--json"],
                                stdout=subprocess.PIPE, stderr=err, text=True,
                                env=clean_env(**live.env()))
        try:
            _wait_for(lambda: "loading checkpoint" in log.read_text(errors="replace"),
                      "publish to start loading", 180)
            proc.send_signal(sig)
            stdout, _ = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=30)
    ran = Ran(proc.returncode, stdout, log.read_text(errors="replace"))
    assert_fails(ran, code, f"interrupted by {signal.Signals(sig).name}: publish of "
                            f"{real_model_checkpoint()} stopped")
    with MxClient(live.server.url, token=TOKEN) as client:
        assert not client.list_sources(model="midway/publish", state="READY")


@pytest.mark.nixl
@pytest.mark.slow
def test_sigint_while_following_a_transfer(live: Live, tmp_path: pathlib.Path) -> None:
    """`transfers start --wait` stops following (130) and says the transfer runs on."""
    from modelexpress.client import MxClient

    agent = ModuleProcess(["modelexpress", "agent", "--id", "bad-input-agent", "--no-serve",
                           "--max-gbps", "0.01", "--chunk-bytes", "1048576"],
                          tmp_path / "agent.log", clean_env(**live.env()))
    with MxClient(live.server.url, token=TOKEN) as client:
        try:
            _wait_for(lambda: any(a.id == "bad-input-agent" for a in client.list_agents()),
                      "the agent to register", 180)
            proc = subprocess.Popen([MODELEXPRESS, "transfers", "start", "--model", MODEL,
                                     "--target", "bad-input-agent", "--wait"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env=clean_env(**live.env()))
            try:
                running = _wait_for(
                    lambda: [t for t in client.list_transfers(target_worker="bad-input-agent")
                             if t.state == "RUNNING" and t.bytes_done > 0],
                    "the transfer to be midway", 180)
                proc.send_signal(signal.SIGINT)
                stdout, stderr = proc.communicate(timeout=60)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate(timeout=30)
            assert_fails(Ran(proc.returncode, stdout, stderr), 130,
                         f"interrupted by SIGINT: stopped following transfer {running[0].id} "
                         "(it keeps running")
            assert client.get_transfer(running[0].id).state in ("RUNNING", "SUCCEEDED")
            client.stop_transfer(running[0].id)
            _wait_for(lambda: client.get_transfer(running[0].id).state in ("STOPPED",
                                                                           "SUCCEEDED"),
                      "the transfer to stop", 60)
        finally:
            code = agent.stop()
    assert code == 0, agent.tail()
