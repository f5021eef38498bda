"""A local Arize Phoenix trace backend, for ``phoenix_trace.py`` and the end-to-end test (not library code).

Optional: ``pip install arize-phoenix opentelemetry-exporter-otlp-proto-http`` (both are imported on
use). ``local_phoenix()`` starts ``phoenix serve`` on free loopback ports with a temporary working
directory (its SQLite database) and stops it on exit; spans reach it over OTLP/HTTP at
``{url}/v1/traces`` and come back through Phoenix's own client.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

STARTUP_TIMEOUT_S = 180.0  # about 20 s on an idle 2-core machine; much more when it is busy


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def local_phoenix(workdir: str | Path | None = None, timeout_s: float = STARTUP_TIMEOUT_S) -> Iterator[str]:
    """Run ``phoenix serve`` on 127.0.0.1 while the block runs; yields its base URL.

    ``workdir``: where Phoenix keeps its database (default: a temporary folder, removed after).
    Raises RuntimeError with the end of the server's log when it exits or is not up in time.
    """
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="phoenix-"))
        workdir = Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        port, grpc_port = _free_port(), _free_port()
        env = {
            **os.environ,
            "PHOENIX_HOST": "127.0.0.1",
            "PHOENIX_PORT": str(port),
            "PHOENIX_GRPC_PORT": str(grpc_port),
            "PHOENIX_WORKING_DIR": str(workdir),
            "PHOENIX_TELEMETRY_ENABLED": "false",
        }
        log_path = workdir / "phoenix.log"
        log = stack.enter_context(open(log_path, "wb"))
        server = subprocess.Popen(
            [sys.executable, "-m", "phoenix.server.main", "serve"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + timeout_s
            while not _healthy(url):
                if server.poll() is not None or time.monotonic() > deadline:
                    tail = log_path.read_text(errors="replace")[-3000:]
                    why = f"exited with {server.returncode}" if server.returncode is not None else "timed out"
                    raise RuntimeError(f"phoenix serve {why} ({url}); its log ends:\n{tail}")
                time.sleep(0.5)
            yield url
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def otlp_processor(url: str, batch: bool = False) -> Any:
    """A span processor exporting over OTLP/HTTP to a Phoenix (or any collector) at ``url``."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    exporter = OTLPSpanExporter(endpoint=f"{url.rstrip('/')}/v1/traces")
    return BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)


def spans_dataframe(url: str, project: str = "default", limit: int = 10_000) -> Any:
    """Every span Phoenix holds for ``project``, through its own client (a pandas DataFrame)."""
    from phoenix.client import Client

    return Client(base_url=url).spans.get_spans_dataframe(project_identifier=project, limit=limit)
