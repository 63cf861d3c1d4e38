"""README.md's code blocks, as a test runs them: every ```python block as a script of its own, the
``ragkv``/``python -m`` lines of every ```bash block as commands (``&``: a server, stopped at the
end), in README order, from the repository root. ``/tmp/ragkv-readme`` (the README's store) becomes
a fresh directory per run; nothing else is changed."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
STORE = "/tmp/ragkv-readme"


def blocks(text: str | None = None) -> list[tuple[str, str]]:
    """(language, code) of every fenced block, in order."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text or README.read_text(), re.S | re.M)]


def commands(code: str) -> list[str]:
    """The lines of a bash block, continuations joined, comments and blank lines dropped."""
    out, cur = [], []
    for line in code.splitlines():
        line = line.rstrip()
        if line.endswith("\\"):
            cur.append(line[:-1])
            continue
        text = re.sub(r"\s+#.*$", "", " ".join([*cur, line])).strip()
        cur = []
        if text and not text.startswith("#"):
            out.append(text)
    return out


class Runner:
    """Runs snippets with this interpreter's environment (its bin/ first on PATH)."""

    def __init__(self, store: Path, env: dict | None = None):
        self.store, self.servers = str(store), []
        bindir = str(Path(sys.executable).parent)
        self.env = {**os.environ, "PATH": bindir + os.pathsep + os.environ.get("PATH", ""), **(env or {})}

    def _fix(self, code: str) -> str:
        return code.replace(STORE, self.store)

    def python(self, code: str, timeout: float = 900) -> str:
        r = subprocess.run([sys.executable, "-c", self._fix(code)], cwd=REPO, env=self.env, capture_output=True,
                           text=True, timeout=timeout)
        assert r.returncode == 0, f"README snippet failed:\n{code}\n--- stderr ---\n{r.stderr[-4000:]}"
        return r.stdout

    def shell(self, line: str, timeout: float = 1800, ready_port: int | None = None) -> str:
        line = self._fix(line)
        if line.endswith("&"):  # a server: started, left running until stop()
            log = open(Path(self.store).parent / f"server-{len(self.servers)}.log", "w")  # noqa: SIM115
            proc = subprocess.Popen(["bash", "-c", "exec " + line.removesuffix("&").strip()], cwd=REPO, env=self.env,
                                    stdout=log, stderr=subprocess.STDOUT)
            self.servers.append((proc, log))
            if ready_port is not None:
                self._wait(ready_port, proc, log.name)
            return ""
        r = subprocess.run(["bash", "-c", line], cwd=REPO, env=self.env, capture_output=True, text=True,
                           timeout=timeout)
        assert r.returncode == 0, f"README command failed: {line}\n--- stderr ---\n{r.stderr[-4000:]}"
        return r.stdout + r.stderr

    def _wait(self, port: int, proc, log: str, timeout: float = 900) -> None:
        end = time.time() + timeout
        while time.time() < end:
            assert proc.poll() is None, f"the server exited:\n{Path(log).read_text()[-4000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    return
            except OSError:
                time.sleep(1)
        raise AssertionError(f"no answer on port {port}:\n{Path(log).read_text()[-4000:]}")

    def stop(self) -> None:
        for proc, log in self.servers:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()


def port_of(line: str) -> int | None:
    args = shlex.split(line.removesuffix("&"))
    return int(args[args.index("--port") + 1]) if "--port" in args else None
