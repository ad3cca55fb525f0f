"""The cluster harness itself: isolation of hosts, shaping, teardown, stale sweep."""

from __future__ import annotations

import pathlib
import subprocess
import time

import pytest

from netns_cluster import PREFIX, NetnsCluster, require_netns, sweep_stale

# A listener that counts bytes, and a sender of 4 MiB, both plain Python.
_LISTEN = ("import socket;s=socket.socket();s.bind(('0.0.0.0',5000));s.listen();"
           "print('{}',flush=True);c,_=s.accept();n=0\n"
           "while (d:=c.recv(1<<20)): n+=len(d)\n"
           "print('{\"n\": %d}' % n, flush=True)")
_SEND = "import socket,sys;s=socket.create_connection((sys.argv[1],5000));s.sendall(b'x'*(4<<20))"


# One UDP datagram of 8000 bytes sent with "don't fragment" (IP_PMTUDISC_DO), and a
# listener that prints the size of what it received.
_UDP_LISTEN = ("import socket;s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM);"
               "s.bind(('0.0.0.0',5001));print('{}',flush=True);d=s.recv(65536);"
               "print('{\"n\": %d}' % len(d), flush=True)")
_UDP_SEND_DF = ("import socket,sys;s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM);"
                "s.setsockopt(socket.IPPROTO_IP,10,2);"  # IP_MTU_DISCOVER, IP_PMTUDISC_DO
                "s.sendto(b'x'*8000,(sys.argv[1],5001))")


_UDP_SEND_SMALL = ("import socket,sys;s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM);"
                   "s.sendto(b'x'*100,(sys.argv[1],5001))")


def _host_facts(proc) -> list[str]:  # noqa: ANN001
    out, _ = proc.proc.communicate(timeout=30)
    assert proc.proc.returncode == 0, proc.tail()
    return out.decode().split()


def test_each_host_has_its_own_boot_id_pid_namespace_hostname_and_shm(
        netns: NetnsCluster) -> None:
    a, b = netns.add_host("alpha"), netns.add_host("beta")
    script = ("cat /proc/sys/kernel/random/boot_id; cat /proc/1/comm; hostname; "
              "ls -A /dev/shm | wc -l; ip -o -4 addr show dev eth0 | awk '{print $4}'")
    facts = {h.name: _host_facts(h.run(["sh", "-c", script], "facts")) for h in (a, b)}
    root_boot_id = pathlib.Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    for host in (a, b):
        boot_id, init, hostname, shm_entries, addr = facts[host.name]
        assert boot_id == host.boot_id != root_boot_id
        assert init == "sleep"  # its own PID namespace, whose PID 1 is the host's init
        assert hostname == host.name
        assert shm_entries == "0"  # a private /dev/shm
        assert addr == f"{host.ip}/24"
    assert facts["alpha"][0] != facts["beta"][0]


def test_processes_of_one_host_share_its_pid_namespace_and_shm(netns: NetnsCluster) -> None:
    host = netns.add_host("h")
    holder = host.run(["sh", "-c", "echo $$ > /dev/shm/holder; echo '{}'; exec sleep 600"],
                      "holder")
    holder.json_line(30)
    peer = host.run(["sh", "-c", "kill -0 $(cat /dev/shm/holder) && echo seen"], "peer")
    out, _ = peer.proc.communicate(timeout=30)
    assert out.decode().strip() == "seen", peer.tail()
    other = netns.add_host("other")
    stranger = other.run(["sh", "-c", "test -e /dev/shm/holder || echo private"], "stranger")
    out, _ = stranger.proc.communicate(timeout=30)
    assert out.decode().strip() == "private", stranger.tail()


def test_bytes_cross_the_bridge_and_the_nic_counters_and_tbf_see_them(
        netns: NetnsCluster) -> None:
    a, b = netns.add_host("a"), netns.add_host("b")
    b.shape(400, ingress_mbit=300)
    qdiscs = b.exec(["tc", "qdisc", "show", "dev", "eth0"]).stdout
    assert "tbf" in qdiscs and "400Mbit" in qdiscs, qdiscs
    outer = subprocess.run(["tc", "qdisc", "show", "dev", b.nic().outer], capture_output=True,
                           text=True, check=True).stdout
    assert "tbf" in outer and "300Mbit" in outer, outer
    listener = b.run(["python3", "-c", _LISTEN], "listen")
    listener.json_line(30)
    rx0, _ = b.nic_bytes()
    _, tx0 = a.nic_bytes()
    sender = a.run(["python3", "-c", _SEND, b.ip], "send")
    assert sender.wait(60) == 0, sender.tail()
    assert listener.json_line(60) == {"n": 4 << 20}
    assert b.nic_bytes()[0] - rx0 >= 4 << 20
    assert a.nic_bytes()[1] - tx0 >= 4 << 20


def test_a_cluster_of_jumbo_frames_carries_them_unfragmented_between_hosts(
        tmp_path: pathlib.Path) -> None:
    """mtu=9000 (bench/cluster.py --mtu): every veth end and the bridge have it, and an
    8000-byte datagram that may not be fragmented crosses from host to host."""
    require_netns()
    with NetnsCluster(tmp_path, mtu=9000) as cluster:
        a, b = cluster.add_host("a"), cluster.add_host("b")
        for dev in (cluster.bridges[0], a.nic().outer, b.nic().outer):
            assert pathlib.Path(f"/sys/class/net/{dev}/mtu").read_text().strip() == "9000"
        assert b.exec(["cat", "/sys/class/net/eth0/mtu"]).stdout.strip() == "9000"
        listener = b.run(["python3", "-c", _UDP_LISTEN], "udp-listen")
        listener.json_line(30)
        sender = a.run(["python3", "-c", _UDP_SEND_DF, b.ip], "udp-send")
        assert sender.wait(30) == 0, sender.tail()  # EMSGSIZE if a link's MTU were smaller
        assert listener.json_line(30) == {"n": 8000}
    assert cluster.leftovers() == []


def test_small_first_shaping_sends_small_packets_in_their_own_class(
        netns: NetnsCluster) -> None:
    """shape(small_first=True) (bench/cluster.py --small-first): an htb tree at the rate
    whose class for packets under 1 KiB sees the small datagrams, and whose bulk class
    sees the 4 MiB a TCP sender pushes; every byte arrives."""
    a, b = netns.add_host("a"), netns.add_host("b")
    a.shape(200, small_first=True)

    def sent_by_class() -> dict[str, int]:
        out = a.exec(["tc", "-s", "class", "show", "dev", "eth0"]).stdout
        counts, cls = {}, ""
        for line in out.splitlines():
            words = line.split()
            if words[:2] == ["class", "htb"]:
                cls = words[2]
            elif words[:1] == ["Sent"]:
                counts[cls] = int(words[3])  # "Sent <bytes> bytes <packets> pkt"
        return counts

    qdiscs = a.exec(["tc", "qdisc", "show", "dev", "eth0"]).stdout
    assert "htb" in qdiscs and "bfifo" in qdiscs, qdiscs
    before = sent_by_class()
    listener = b.run(["python3", "-c", _UDP_LISTEN], "udp-listen")
    listener.json_line(30)
    small = a.run(["python3", "-c", _UDP_SEND_SMALL, b.ip], "udp-send")
    assert small.wait(30) == 0, small.tail()
    assert listener.json_line(30) == {"n": 100}
    mid = sent_by_class()
    assert mid["1:10"] - before.get("1:10", 0) >= 1
    bulk_listener = b.run(["python3", "-c", _LISTEN], "listen")
    bulk_listener.json_line(30)
    sender = a.run(["python3", "-c", _SEND, b.ip], "send")
    assert sender.wait(60) == 0, sender.tail()
    assert bulk_listener.json_line(60) == {"n": 4 << 20}
    after = sent_by_class()
    assert after["1:20"] - mid.get("1:20", 0) >= 1000  # the bulk's packets
    assert after["1:10"] - mid["1:10"] >= 1  # its ACK-sized packets (SYN, FIN) stay small


def test_a_link_set_down_cuts_the_host_off(netns: NetnsCluster) -> None:
    a, b = netns.add_host("a"), netns.add_host("b")
    listener = b.run(["python3", "-c", _LISTEN], "listen")
    listener.json_line(30)
    a.set_link(False)
    sender = a.run(["python3", "-c", _SEND, b.ip], "send")
    assert sender.wait(60) != 0  # "Network is unreachable"
    assert "unreachable" in sender.tail().lower()


def test_teardown_removes_everything_even_after_a_failure(tmp_path: pathlib.Path) -> None:
    require_netns()
    with pytest.raises(RuntimeError, match="the test failed"):
        with NetnsCluster(tmp_path, bridges=2) as cluster:
            host = cluster.add_host("h", nics=2)
            sleeper = host.run(["sleep", "600"], "sleep")
            assert sleeper.inner_pid() is not None
            assert len(cluster.leftovers()) == 1 + 2 + 2  # netns, bridges, outer veth ends
            raise RuntimeError("the test failed")
    assert cluster.leftovers() == []
    assert sleeper.proc.poll() is not None


def test_leftovers_of_a_dead_owner_are_swept_and_a_live_owners_kept(
        tmp_path: pathlib.Path) -> None:
    require_netns()
    dead = subprocess.Popen(["true"])
    dead.wait(10)
    live = subprocess.Popen(["sleep", "600"])
    try:
        stale = f"{PREFIX}{dead.pid:06x}0"
        alive = f"{PREFIX}{live.pid:06x}0"
        for prefix in (stale, alive):
            subprocess.run(["ip", "netns", "add", f"{prefix}h01"], check=True)
            subprocess.run(["ip", "link", "add", f"{prefix}b0", "type", "bridge"], check=True)
        # a process left running in the stale host (its owner died without teardown)
        orphan = subprocess.Popen(["ip", "netns", "exec", f"{stale}h01", "sleep", "600"])
        time.sleep(0.2)
        removed = sweep_stale()
        assert sorted(removed) == sorted([f"{stale}h01", f"{stale}b0"])
        assert orphan.wait(10) == -9
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert f"{alive}h01" in names and f"{stale}h01" not in names
    finally:
        live.kill()
        live.wait(10)
        subprocess.run(["ip", "netns", "del", f"{PREFIX}{live.pid:06x}0h01"])
        subprocess.run(["ip", "link", "del", f"{PREFIX}{live.pid:06x}0b0"])
