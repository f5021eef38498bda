"""A server in a child process on loopback: started, waited for, stopped (``ServerProcess``).

What runs ``agentspec serve``, a vLLM worker or a router as a process of its own uses this: the
tests, the benchmarks and the fleet. The child writes its output to a log file (a pipe nobody reads
would fill and stall it); a start that fails says why with the log's tail.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

STARTUP_TIMEOUT_S = 300.0  # loading a model and, for vLLM, compiling its graphs, on a busy CPU
STOP_TIMEOUT_S = 30.0  # after SIGTERM: the time a server has to finish its pass and save its cache


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def checkout_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a child Python that imports this ``agentspec`` (a checkout's, say), with
    passive OpenMP waits (spinning threads of two processes starve each other on a few cores)."""
    root = str(Path(__file__).resolve().parents[2])  # the folder holding this agentspec package
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_WAIT_POLICY": "PASSIVE", **(extra or {})}


def agentspec_serve_command(port: int, *options: str, python: str = sys.executable) -> list[str]:
    """``agentspec serve`` on 127.0.0.1:``port`` with ``options`` (as the CLI takes them)."""
    return [python, "-m", "agentspec.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *options]


def healthy(url: str, path: str = "/health") -> bool:
    try:
        with urllib.request.urlopen(f"{url}{path}", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


class ServerProcess:
    """``command`` as a child process serving HTTP on ``port``; a context manager that waits for
    ``health_path`` to answer 200 and stops the child (SIGTERM, then SIGKILL) on exit.

    ``url`` is ``http://127.0.0.1:{port}``. ``log`` is where the child's output goes (a temporary
    file when None). ``stop`` may be called early (a test killing a worker) and again later.
    """

    def __init__(
        self,
        command: Sequence[str],
        port: int,
        *,
        env: dict[str, str] | None = None,
        log: Path | None = None,
        health_path: str = "/health",
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
    ):
        self.command, self.port, self.env = list(command), port, env
        self.url = f"http://127.0.0.1:{port}"
        self.log = (
            log if log is not None else Path(tempfile.mkstemp(prefix="agentspec-server-", suffix=".log")[1])
        )
        self.health_path, self.startup_timeout_s = health_path, startup_timeout_s
        self.process: subprocess.Popen | None = None

    def start(self) -> ServerProcess:
        with open(self.log, "wb") as log:  # the child keeps its own handle
            self.process = subprocess.Popen(
                self.command, env=self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        deadline = time.monotonic() + self.startup_timeout_s
        while not healthy(self.url, self.health_path):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"{' '.join(self.command[:6])} ... did not come up on {self.url} "
                    f"(exit status {self.process.returncode}); its log, {self.log}:\n{self.log_tail()}"
                )
            time.sleep(0.25)
        return self

    def stop(self, kill: bool = False) -> None:
        """Stop the child: SIGTERM (SIGKILL with ``kill``: a crash), SIGKILL if it outlives the wait."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.kill() if kill else self.process.terminate()
        try:
            self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=STOP_TIMEOUT_S)

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
