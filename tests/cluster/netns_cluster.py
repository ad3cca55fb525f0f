"""A cluster of "hosts" on one machine: network, PID, mount and UTS namespaces on bridges.

Each :class:`Host` is what UCX and modelexpress would see on a separate machine:

- its own network namespace, joined to one bridge per NIC by a veth pair; the end
  inside the host is renamed ``eth0``, ``eth1``, ... and gets its own IP; ``lo`` is up;
- one PID, mount, UTS and IPC namespace per host, held by a small init started with
  the host (``ip netns exec`` + ``unshare --pid --mount --uts --ipc --fork
  --mount-proc``); in
  that mount namespace a file is bind-mounted over ``/proc/sys/kernel/random/boot_id``
  (the host's own boot id), ``/dev/shm`` is a private tmpfs, and the hostname is the
  host's name. Processes enter all of the host's namespaces with ``nsenter``, so two
  processes of one host see each other (and may share memory) as on a real machine.
  UCX decides that two processes share a machine (so shared memory and CMA may
  connect them) from the boot id, so across hosts UCX must go over the network;
- its link can be shaped with ``tc``: a token bucket (``tbf``) caps each direction
  (egress on the NIC inside the host, ingress on the bridge-side end of the veth,
  i.e. what the bridge sends into the host) and ``netem`` adds one-way latency
  (where the kernel has ``sch_netem``: the CPU machines' kernel lacks it, and
  ``Host.shape(delay_ms=...)`` then fails saying so).

Names. Every namespace, link and bridge is named ``mxn<pid:6 hex><n:1 hex>...``
(``pid`` of the process that built it, ``n`` a per-process counter), which keeps
interface names within the kernel's 15 characters. On start, leftovers whose owner
pid is no longer alive are removed (a run killed before its teardown); leftovers of
live owners (a parallel run) are left alone.

Teardown (:meth:`NetnsCluster.close`, also on ``__exit__``, even after a failure):
every process gets SIGTERM, then SIGKILL after a bounded wait (SIGKILL of a PID
namespace's init kills everything in that namespace); then every namespace, veth and
bridge is deleted. The bind mount and the tmpfs live in the host's mount namespace
and vanish with its init.

Processes. A command runs as a child of ``nsenter``; the harness signals the command
itself (its pid in the root namespace). Processes that outlive their parent (a
publisher's guardian) are reparented to the host's init, as on a real host, and die
with it at teardown (SIGKILL of a PID namespace's init kills all of it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import selectors
import signal
import subprocess
import time
import uuid
from typing import Any, Sequence

__all__ = ["NetnsCluster", "Host", "HostProcess", "Nic", "sweep_stale", "netns_available",
           "require_netns"]

PREFIX = "mxn"
_NAME = re.compile(rf"^{PREFIX}([0-9a-f]{{6}})")
_CMD_DEADLINE_S = 20.0
_counter = 0


def _sh(argv: Sequence[str], check: bool = True, timeout: float = _CMD_DEADLINE_S
        ) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({out.returncode}): {out.stderr.strip()}")
    return out


def netns_available() -> str | None:
    """None when this machine can build a cluster, else why not (for a skip reason)."""
    if os.geteuid() != 0:
        return "needs root (ip netns, veth, bridges, tc, unshare)"
    for tool in ("ip", "tc", "unshare", "mount"):
        if subprocess.run(["which", tool], capture_output=True).returncode != 0:
            return f"{tool} is not installed"
    return None


def require_netns() -> None:
    """In a test: skip (or, with ``MX_REQUIRE_DEPS=1`` as CI sets, fail) saying why
    this machine cannot build a cluster."""
    import pytest

    reason = netns_available()
    if reason is None:
        return
    if os.environ.get("MX_REQUIRE_DEPS") == "1":
        pytest.fail(f"MX_REQUIRE_DEPS=1 but the cluster harness {reason}", pytrace=False)
    pytest.skip(f"the cluster harness {reason}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Delete namespaces and links left by dead owners; returns what was removed.

    A stale namespace's processes (its host's init, which kept running because the
    owner died without a teardown, and whatever ran in the host) are killed first.
    """
    removed = []
    for line in _sh(["ip", "netns", "list"], check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NAME.match(name)
        if m and not _pid_alive(int(m.group(1), 16)):
            for pid in _sh(["ip", "netns", "pids", name], check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            if _sh(["ip", "netns", "del", name], check=False).returncode == 0:
                removed.append(name)
    links = _sh(["ip", "-o", "link", "show"], check=False).stdout.splitlines()
    for line in links:
        parts = line.split(":", 2)
        if len(parts) < 2:
            continue
        name = parts[1].strip().split("@")[0]
        m = _NAME.match(name)
        if m and not _pid_alive(int(m.group(1), 16)):
            if _sh(["ip", "link", "del", name], check=False).returncode == 0:
                removed.append(name)
    return removed


@dataclasses.dataclass
class Nic:
    """One NIC of a host: ``name`` inside the host, ``outer`` its veth end on ``bridge``."""

    name: str
    outer: str
    bridge: str
    ip: str


class HostProcess:
    """A command running in a host (in all of the host's namespaces).

    stdout is piped (for :meth:`json_line`), stderr goes to ``log_path``.
    """

    def __init__(self, host: "Host", argv: Sequence[str], log_path: pathlib.Path,
                 env: dict[str, str]) -> None:
        self.host = host
        self.argv = list(argv)
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        init = host.init_pid()
        cmd = ["nsenter", "-t", str(init), "--net", "--pid", "--mount", "--uts", "--ipc",
               "--", *self.argv]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log, env=env,
                                     start_new_session=True)
        self._inner: int | None = None
        self._stdout_buf = b""

    def inner_pid(self, deadline_s: float = 10.0) -> int | None:
        """The command's pid as this (root) namespace sees it: nsenter's child."""
        if self._inner is not None:
            return self._inner
        end = time.monotonic() + deadline_s
        path = pathlib.Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        while time.monotonic() < end and self.proc.poll() is None:
            try:
                kids = path.read_text().split()
            except OSError:
                kids = []
            if kids:
                self._inner = int(kids[0])
                return self._inner
            time.sleep(0.02)
        return None

    def json_line(self, deadline_s: float) -> dict[str, Any]:
        """The first JSON object the command prints on stdout (other lines skipped).

        Raises:
            TimeoutError: nothing within ``deadline_s`` or the command exited first.
        """
        assert self.proc.stdout is not None
        # os.read, not readline: a buffered readline may swallow several lines at once
        # and leave the JSON one in Python's buffer, where select() cannot see it.
        fd = self.proc.stdout.fileno()
        sel = selectors.DefaultSelector()
        sel.register(fd, selectors.EVENT_READ)
        end = time.monotonic() + deadline_s
        try:
            while time.monotonic() < end:
                while b"\n" in self._stdout_buf:
                    line, self._stdout_buf = self._stdout_buf.split(b"\n", 1)
                    if line.startswith(b"{"):
                        return json.loads(line)
                if not sel.select(timeout=0.5):
                    continue
                chunk = os.read(fd, 1 << 16)
                if chunk:
                    self._stdout_buf += chunk
                    continue
                # EOF: the command exited or closed stdout
                if self._stdout_buf.startswith(b"{"):
                    line, self._stdout_buf = self._stdout_buf, b""
                    return json.loads(line)
                try:
                    self.proc.wait(max(min(end - time.monotonic(), 10.0), 0.1))
                except subprocess.TimeoutExpired:
                    pass
                break
        finally:
            sel.close()
        raise TimeoutError(f"{self.argv[:3]} on {self.host.name} printed no JSON line within "
                           f"{deadline_s:.0f} s (exit code {self.proc.poll()}); log:\n"
                           f"{self.tail()}")

    def wait(self, timeout_s: float) -> int:
        """The exit code; raises ``subprocess.TimeoutExpired`` after ``timeout_s``."""
        return self.proc.wait(timeout_s)

    def tail(self, chars: int = 4000) -> str:
        if not self._log.closed:
            self._log.flush()
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(log unavailable)"

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the command (not to ``nsenter``)."""
        pid = self.inner_pid(2.0)
        if pid is not None and self.proc.poll() is None:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGTERM to the command, SIGKILL after ``timeout_s``; returns the exit code."""
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        if not self._log.closed:
            self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL of the command (a crash; its children live on, as on a real host)."""
        if self.proc.poll() is None:
            self.signal(signal.SIGKILL)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


class Host:
    """One machine of the cluster (see the module docstring)."""

    def __init__(self, cluster: "NetnsCluster", index: int, name: str) -> None:
        self.cluster = cluster
        self.index = index
        self.name = name
        self.netns = f"{cluster.prefix}h{index:02d}"
        self.nics: list[Nic] = []
        self.boot_id = str(uuid.uuid4())
        self.boot_id_file = cluster.workdir / f"boot_id-{name}"
        self.boot_id_file.write_text(self.boot_id + "\n")
        self.procs: list[HostProcess] = []
        self._init: subprocess.Popen[bytes] | None = None
        self._init_pid: int | None = None

    def start_init(self) -> None:
        """Start the host's init: it holds the PID, mount and UTS namespaces.

        ``--kill-child``: if ``unshare`` dies, the init gets SIGKILL, and with it every
        process of the host's PID namespace, so nothing outlives the harness.
        """
        setup = (f"mount --bind {self.boot_id_file} /proc/sys/kernel/random/boot_id && "
                 "mount -t tmpfs -o size=2g tmpfs /dev/shm && "
                 f"hostname {self.name} && echo ready && exec sleep infinity")
        self._init = subprocess.Popen(
            ["ip", "netns", "exec", self.netns, "unshare", "--pid", "--mount", "--uts",
             "--ipc", "--fork", "--mount-proc", "--kill-child=SIGKILL", "--propagation",
             "private", "sh", "-c", setup],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        assert self._init.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self._init.stdout, selectors.EVENT_READ)
        try:
            ready = sel.select(timeout=_CMD_DEADLINE_S)
        finally:
            sel.close()
        line = self._init.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            self._init.kill()
            _, err = self._init.communicate(timeout=10)
            raise RuntimeError(f"init of host {self.name} did not start: {err.decode()}")
        children = pathlib.Path(f"/proc/{self._init.pid}/task/{self._init.pid}/children")
        self._init_pid = int(children.read_text().split()[0])

    def init_pid(self) -> int:
        """The pid (root namespace) of the host's init, whose namespaces commands enter."""
        if self._init_pid is None:
            raise RuntimeError(f"host {self.name} has no init (closed?)")
        return self._init_pid

    def stop_init(self) -> None:
        """SIGKILL the init: the kernel kills every process left in the host."""
        if self._init is None:
            return
        if self._init.poll() is None:
            if self._init_pid is not None:
                try:
                    os.kill(self._init_pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                self._init.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self._init.pid, signal.SIGKILL)
                self._init.wait(10)
        for stream in (self._init.stdout, self._init.stderr):
            if stream is not None:
                stream.close()
        self._init = None
        self._init_pid = None

    @property
    def ip(self) -> str:
        """The address of the first NIC."""
        return self.nics[0].ip

    def exec(self, argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a short command in this host's network namespace (no PID namespace)."""
        return _sh(["ip", "netns", "exec", self.netns, *argv], check=check)

    def run(self, argv: Sequence[str], name: str, env: dict[str, str] | None = None
            ) -> HostProcess:
        """Start ``argv`` in this host; stderr goes to ``<workdir>/<host>-<name>.log``."""
        n = len(self.procs) + 1
        proc = HostProcess(self, argv, self.cluster.workdir / f"{self.name}-{name}-{n}.log",
                           {**os.environ, **(env or {})})
        self.procs.append(proc)
        return proc

    def nic(self, name: str = "eth0") -> Nic:
        for nic in self.nics:
            if nic.name == name:
                return nic
        raise KeyError(f"{self.name} has no NIC {name} (has {[n.name for n in self.nics]})")

    def fake_rdma_devices(self, names: Sequence[str] = ("mlx5_0",)) -> None:
        """Make ``/sys/class/infiniband`` list ``names`` for every later command of this
        host (an RDMA NIC the kernel lists but UCX cannot use: no verbs device).

        Done in the host's own mount namespace, so it goes with the host: ``/sys/class``
        is bind-mounted aside into the host's ``/dev/shm``, a tmpfs put over it, each
        class mounted back, and the fake class created. No file of the machine changes.
        """
        aside = "/dev/shm/.mx-sys-class"
        script = (f"set -e; mkdir -p {aside}; mount --bind /sys/class {aside}; "
                  "mount -t tmpfs -o size=1m mx-sys-class /sys/class; "
                  f"for d in {aside}/*; do n=$(basename \"$d\"); mkdir \"/sys/class/$n\"; "
                  "mount --bind \"$d\" \"/sys/class/$n\"; done; "
                  + "; ".join(f"mkdir -p /sys/class/infiniband/{n}" for n in names))
        _sh(["nsenter", "-t", str(self.init_pid()), "--mount", "--", "sh", "-c", script])

    def set_link(self, up: bool, nic: str = "eth0") -> None:
        """``ip link set up|down`` on the NIC inside the host (a cable pulled)."""
        self.exec(["ip", "link", "set", self.nic(nic).name, "up" if up else "down"])

    def nic_bytes(self, nic: str = "eth0") -> tuple[int, int]:
        """(rx_bytes, tx_bytes) of a NIC, read from /sys inside the host's namespace."""
        out = self.exec(["cat", f"/sys/class/net/{nic}/statistics/rx_bytes",
                         f"/sys/class/net/{nic}/statistics/tx_bytes"]).stdout.split()
        return int(out[0]), int(out[1])

    def shape(self, rate_mbit: float | None, *, ingress_mbit: float | None = None,
              delay_ms: float = 0.0, nic: str = "eth0", queue_ms: float = 100.0,
              small_first: bool = False) -> None:
        """Cap a NIC's send rate (and receive rate: ``ingress_mbit``, default the same)
        with ``tbf``, and add ``delay_ms`` of one-way latency with ``netem`` on sends.

        ``None`` leaves a direction uncapped. ``queue_ms``: tbf's ``latency``, the most a
        packet waits in the queue (a deep queue delays a host's small packets, READ
        requests and ACKs, behind the bulk data it sends). ``small_first``: shape with
        ``htb`` instead, packets under 1 KiB (requests, ACKs) in a class served before
        the bulk one, as a host's fair queue (``fq_codel``, Linux's default, which this
        kernel lacks) serves a sparse flow before a backlogged one; no ``delay_ms``
        then. Replaces any earlier shaping.
        """
        n = self.nic(nic)
        ingress = rate_mbit if ingress_mbit is None else ingress_mbit
        shaper = _shape_small_first if small_first else _shape
        if small_first and delay_ms > 0:
            raise ValueError("small_first shaping adds no delay (no netem under htb here)")
        shaper(["ip", "netns", "exec", self.netns], n.name, rate_mbit, delay_ms, queue_ms)
        shaper([], n.outer, ingress, 0.0, queue_ms)


def _shape(prefix: list[str], dev: str, rate_mbit: float | None, delay_ms: float,
           queue_ms: float = 100.0) -> None:
    _sh([*prefix, "tc", "qdisc", "del", "dev", dev, "root"], check=False)
    if rate_mbit is None and delay_ms <= 0:
        return
    if rate_mbit is None:
        _sh([*prefix, "tc", "qdisc", "add", "dev", dev, "root", "netem",
             "delay", f"{delay_ms}ms", "limit", "100000"])
        return
    # A bucket of ~4 ms at the rate, at least 64 KiB: veth hands tbf GSO packets of
    # up to 64 KiB, and a smaller bucket would make tbf split or drop them.
    burst = max(int(rate_mbit * 1e6 / 8 * 0.004), 64 << 10)
    _sh([*prefix, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf",
         "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", f"{queue_ms:g}ms"])
    if delay_ms > 0:
        _sh([*prefix, "tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:",
             "netem", "delay", f"{delay_ms}ms", "limit", "100000"])


def _shape_small_first(prefix: list[str], dev: str, rate_mbit: float | None,
                       delay_ms: float, queue_ms: float = 100.0) -> None:
    """``rate_mbit`` in all, with packets under 1 KiB (the IP header's total length)
    sent ahead of the rest; the bulk class queues at most ``queue_ms`` of bytes."""
    _sh([*prefix, "tc", "qdisc", "del", "dev", dev, "root"], check=False)
    if rate_mbit is None:
        return
    rate = f"{rate_mbit}mbit"
    burst = str(max(int(rate_mbit * 1e6 / 8 * 0.004), 64 << 10))  # as _shape's
    tc = [*prefix, "tc"]
    _sh([*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "20"])
    _sh([*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb",
         "rate", rate, "ceil", rate, "burst", burst, "cburst", burst])
    for cls, prio, share in (("1:10", "0", 0.1), ("1:20", "1", 0.9)):
        _sh([*tc, "class", "add", "dev", dev, "parent", "1:1", "classid", cls, "htb",
             "rate", f"{rate_mbit * share}mbit", "ceil", rate, "prio", prio,
             "burst", burst, "cburst", burst])
    limit = max(int(rate_mbit * 1e6 / 8 * queue_ms / 1e3), 128 << 10)
    _sh([*tc, "qdisc", "add", "dev", dev, "parent", "1:20", "bfifo", "limit", str(limit)])
    # IPv4 total length (offset 2) below 1024: the top six bits clear.
    _sh([*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1",
         "u32", "match", "u16", "0x0000", "0xfc00", "at", "2", "flowid", "1:10"])


class NetnsCluster:
    """Hosts on bridges; build with :meth:`add_host`, tear down with :meth:`close`.

    Args:
        workdir: logs and boot-id files go here.
        bridges: how many bridges (networks); NIC ``k`` of every host is on bridge ``k``.
        mtu: of every veth and bridge (1500 as a veth's default; 9000 for jumbo frames:
            bulk TCP then went in ~50 KB packets instead of ~1.8 KB, bench/cluster.py).

    The root namespace gets the address ``.254`` on every bridge, so the test process
    can reach servers running in hosts (it runs no NIXL itself).
    """

    def __init__(self, workdir: pathlib.Path, bridges: int = 1, mtu: int = 1500) -> None:
        global _counter
        reason = netns_available()
        if reason is not None:
            raise RuntimeError(f"cannot build a netns cluster: {reason}")
        sweep_stale()
        _counter = (_counter + 1) % 16
        pid = os.getpid()
        self.prefix = f"{PREFIX}{pid % (1 << 24):06x}{_counter:x}"
        self.workdir = pathlib.Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.hosts: list[Host] = []
        self.bridges: list[str] = []
        self.subnets: list[str] = []
        self.mtu = mtu
        # 10.<100..199>.<counter*4 + bridge>.0/24: distinct for parallel owners (pids).
        second = 100 + pid % 100
        try:
            for b in range(bridges):
                name = f"{self.prefix}b{b}"
                _sh(["ip", "link", "add", name, "mtu", str(mtu), "type", "bridge"])
                self.bridges.append(name)
                subnet = f"10.{second}.{_counter * 4 + b}"
                self.subnets.append(subnet)
                _sh(["ip", "addr", "add", f"{subnet}.254/24", "dev", name])
                _sh(["ip", "link", "set", name, "up"])
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "NetnsCluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add_host(self, name: str, nics: int = 1) -> Host:
        """A host with ``nics`` NICs (``eth0`` on bridge 0, ``eth1`` on bridge 1, ...)."""
        if nics > len(self.bridges):
            raise ValueError(f"{nics} NICs need {nics} bridges; the cluster has "
                             f"{len(self.bridges)}")
        index = len(self.hosts) + 1
        if index > 99:
            raise ValueError("at most 99 hosts")
        host = Host(self, index, name)
        self.hosts.append(host)
        _sh(["ip", "netns", "add", host.netns])
        host.exec(["ip", "link", "set", "lo", "up"])
        for k in range(nics):
            outer = f"{self.prefix}{index:02d}{k}"
            inner_tmp = f"{outer}p"
            _sh(["ip", "link", "add", outer, "mtu", str(self.mtu), "type", "veth", "peer",
                 "name", inner_tmp, "mtu", str(self.mtu)])
            _sh(["ip", "link", "set", inner_tmp, "netns", host.netns])
            _sh(["ip", "link", "set", outer, "master", self.bridges[k]])
            _sh(["ip", "link", "set", outer, "up"])
            nic = Nic(f"eth{k}", outer, self.bridges[k], f"{self.subnets[k]}.{index}")
            host.exec(["ip", "link", "set", inner_tmp, "name", nic.name])
            host.exec(["ip", "addr", "add", f"{nic.ip}/24", "dev", nic.name])
            host.exec(["ip", "link", "set", nic.name, "up"])
            host.nics.append(nic)
        host.start_init()
        return host

    def close(self) -> None:
        """Stop every process, then delete every namespace, veth and bridge (idempotent)."""
        for host in self.hosts:
            for proc in host.procs:
                if proc.proc.poll() is None:
                    proc.signal(signal.SIGTERM)
        end = time.monotonic() + 15.0
        for host in self.hosts:
            for proc in host.procs:
                try:
                    proc.proc.wait(max(end - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    pass
                proc.kill()
                proc.stop(1.0)
        for host in self.hosts:
            host.stop_init()
            for nic in host.nics:
                _sh(["ip", "link", "del", nic.outer], check=False)
            _sh(["ip", "netns", "del", host.netns], check=False)
        for name in self.bridges:
            _sh(["ip", "link", "del", name], check=False)
        self.hosts = []
        self.bridges = []

    def leftovers(self) -> list[str]:
        """Namespaces and links of this cluster still present (empty after close)."""
        found = [n for n in _sh(["ip", "netns", "list"]).stdout.split() if
                 n.startswith(self.prefix)]
        for line in _sh(["ip", "-o", "link", "show"]).stdout.splitlines():
            parts = line.split(":", 2)
            if len(parts) >= 2 and parts[1].strip().split("@")[0].startswith(self.prefix):
                found.append(parts[1].strip().split("@")[0])
        return found
