"""A redis-server of the tests' own on a free port (the one starter every test uses).

Without the binary the tests skip locally and FAIL when CI is set: Redis tests must never vanish
silently in CI (.ci/run installs and starts redis-server)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# a password with the characters that break naive URI masking ('@' and ':'); tests assert that its
# distinctive tail never shows up in any output
SECRET = "p@ss:w0rd-S3CRET"
SECRET_TAIL = "S3CRET"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, port: int | None = None, password: str | None = None):
        self.port = port or free_port()
        self.password = password  # --requirepass: clients must AUTH (tests of secrets and auth errors)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        exe = shutil.which("redis-server")
        if exe is None:
            raise FileNotFoundError("redis-server not on PATH")
        args = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        if self.password is not None:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(
            args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith((b"+PONG", b"-NOAUTH")):  # up (with or without a password)
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None


def start_or_skip(password: str | None = None) -> RedisServer:
    try:
        return RedisServer(password=password).start()
    except (FileNotFoundError, RuntimeError) as e:
        if IN_CI:
            pytest.fail(f"CI is set but no redis-server could be started: {e}")
        pytest.skip(f"no redis-server: {e}")
