"""A real ``ragkv serve`` process of the tests' own on a free loopback port (the console command, not
an in-process app), its log kept for assertions."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx
from redis_server import free_port


class ServeProcess:
    def __init__(self, model: str, store: str, *args: str, model_dtype: str = "float32", env: dict | None = None):
        """``args``: more options of ``ragkv serve``; ``env``: more environment (e.g. RAGKV_API_KEY).
        The corpus store is created first, as ``ragkv precompute`` would: serve only reads it."""
        from ragkv.store import open_store

        open_store(store).close()
        self.port = free_port()
        self.args = [sys.executable, "-m", "ragkv.cli", "serve", "--store", store, "--model", model,
                     "--model-dtype", model_dtype, "--port", str(self.port), *args]
        self.env = env or {}
        self.log = tempfile.NamedTemporaryFile("w+", prefix="ragkv-serve-", suffix=".log")  # noqa: SIM115
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 600.0) -> ServeProcess:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **self.env}  # 1 thread: 2 shared cores
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ragkv serve exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                time.sleep(0.2)
        out = self.output()
        self.stop()
        raise TimeoutError(f"ragkv serve did not answer /health within {timeout} s:\n{out}")

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def metrics(self, headers: dict | None = None) -> dict[str, float]:
        """/metrics as {sample name with labels: value}."""
        r = httpx.get(f"{self.url}/metrics", timeout=10, headers=headers)
        r.raise_for_status()
        text = r.text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM, then wait for the exit; -> the exit status."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
