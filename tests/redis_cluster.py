"""A real 3-master Redis Cluster of the tests' own, on free ports (the one starter every test uses).

Three ``redis-server --cluster-enabled yes`` processes, joined by ``redis-cli --cluster create ...
--cluster-replicas 0``; ready once every node reports ``cluster_state:ok``. Without the binaries the
tests skip locally and FAIL when CI is set (.ci/run installs redis-server and redis-tools)."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from redis_server import IN_CI


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cluster_ports(n: int) -> list[int]:
    """n distinct ports P with P and its cluster-bus port P + 10000 both free (so P < 55536)."""
    out: list[int] = []
    while len(out) < n:
        p = random.randint(20000, 45000)
        if p not in out and p + 10000 not in out and _bindable(p) and _bindable(p + 10000):
            out.append(p)
    return out


def _ask(port: int, *cmd: str, timeout: float = 0.5) -> bytes:
    """One inline command to 127.0.0.1:port, the raw reply (no client library: this is the fixture)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall((" ".join(cmd) + "\r\n").encode())
        time.sleep(0.02)
        return s.recv(65536)


class RedisCluster:
    def __init__(self, masters: int = 3):
        self.ports = cluster_ports(masters)
        self.procs: dict[int, subprocess.Popen] = {}
        self.dir = Path(tempfile.mkdtemp(prefix="ragkv-cluster-"))

    @property
    def url(self) -> str:
        """The store URI of the cluster (any node is a seed; redis-py discovers the others)."""
        return f"redis+cluster://127.0.0.1:{self.ports[0]}/0"

    @property
    def client_url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def start(self) -> RedisCluster:
        server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if server is None or cli is None:
            raise FileNotFoundError("redis-server and redis-cli must be on PATH (apt-get install redis-server)")
        for p in self.ports:
            self._launch(server, p)
        for p in self.ports:
            self._wait(lambda p=p: _ask(p, "PING").startswith(b"+PONG"), f"node {p} did not answer")
        out = subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
                              "--cluster-replicas", "0", "--cluster-yes"],
                             capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            self.stop()
            raise RuntimeError(f"redis-cli --cluster create failed: {out.stdout[-500:]} {out.stderr[-500:]}")
        for p in self.ports:
            self._wait(lambda p=p: b"cluster_state:ok" in _ask(p, "CLUSTER", "INFO"), f"node {p}: cluster not ok")
        return self

    def _launch(self, server: str, p: int) -> None:
        self.procs[p] = subprocess.Popen(
            [server, "--port", str(p), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
             "--cluster-config-file", str(self.dir / f"nodes-{p}.conf"), "--dir", str(self.dir),
             "--cluster-node-timeout", "2000", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def restart(self, port: int) -> None:
        """Start a killed master again from its nodes-PORT.conf: it takes back its slots, empty
        (no persistence), and the cluster is ok again."""
        self._launch(shutil.which("redis-server"), port)
        for p in self.ports:
            self._wait(lambda p=p: b"cluster_state:ok" in _ask(p, "CLUSTER", "INFO"), f"node {p}: cluster not ok")

    def master_of(self, port: int):
        """A plain redis-py client of one master (to look at what that node holds)."""
        import redis

        return redis.Redis(host="127.0.0.1", port=port)

    def _wait(self, ready, what: str, seconds: float = 20) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                if ready():
                    return
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(what)

    def kill(self, port: int) -> None:
        """SIGKILL one master (its slots become unreachable: the cluster cannot serve them)."""
        proc = self.procs.pop(port)
        proc.kill()
        proc.wait(timeout=10)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
        self.procs.clear()
        shutil.rmtree(self.dir, ignore_errors=True)


def start_cluster_or_skip(masters: int = 3) -> RedisCluster:
    try:
        return RedisCluster(masters).start()
    except (FileNotFoundError, RuntimeError, subprocess.TimeoutExpired) as e:
        if IN_CI:
            pytest.fail(f"CI is set but no Redis Cluster could be started: {e}")
        pytest.skip(f"no Redis Cluster: {e}")
