"""vllm-router in front of the workers: its command line, and where it sent each session.

The router (PyPI ``vllm-router``, a dev extra) forwards OpenAI requests, ``Authorization`` included,
so the workers' API keys guard the fleet. With ``consistent_hash`` it hashes the ``X-Session-ID``
header onto a ring of the healthy workers: a session's turns meet the prefix cache its earlier
turns filled, and a dead worker's sessions move to the next worker on the ring (cache misses there,
the same greedy replies).

Failure handling, so that a dead worker costs a few hundred milliseconds and no failed request:
every attempt of a request re-picks its worker, and a refused connection fails at once. With the
circuit breaker opening after ``CB_FAILURE_THRESHOLD`` failed attempts, fewer than
``RETRY_MAX_RETRIES`` attempts, the first request sent to a dead worker opens its breaker itself and
its last attempt reaches a live worker. The runtime health check takes a worker that stays down off
the ring until it answers again; a breaker that half-opens sends one attempt to the dead
worker, which fails at once and reopens it. The router's defaults (5 attempts, a breaker at 10
failures, a health check a minute) answer a session's first two requests after a worker dies with
500. A 500 from a live worker (a failed decode) is retried too, on the same worker while its breaker
holds.

A worker's 503 (its queue full) counts against its breaker too, and an open breaker sends the
worker's sessions elsewhere (cache misses) or, with one worker, answers 503 until it half-opens; so
fleet workers get a deep queue (``agentspec.fleet.workers.WORKER_QUEUE_SIZE``). The router cannot
bound the requests it has in flight instead: its ``--max-concurrent-requests`` is a token bucket
refilled at that many requests a second, whose queue answers 408 within about a second.
"""

from __future__ import annotations

import re
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

POLICIES = (
    "consistent_hash",
    "round_robin",
    "random",
    "cache_aware",
    "power_of_two",
    "sticky_least_loaded",
    "kv_aware",
)
RETRY_MAX_RETRIES = 4  # attempts per request, the first included (the router's own count)
RETRY_INITIAL_BACKOFF_MS = 50  # a refused connection fails in microseconds: retry soon
RETRY_MAX_BACKOFF_MS = 500
CB_FAILURE_THRESHOLD = 3  # failed attempts that open a worker's breaker: below RETRY_MAX_RETRIES
CB_TIMEOUT_S = 10  # an open breaker lets one attempt through after this (a restarted worker returns)
HEALTH_CHECK_INTERVAL_S = 5
HEALTH_FAILURE_THRESHOLD = 2  # missed checks that take a worker off the ring

# the line the router logs (at info) for every consistent-hash choice
_CHOICE = re.compile(
    r"Consistent hash routing: key='header:x-session-id:(?P<session>.*?)' -> worker='(?P<worker>[^']+)'"
)


def router_binary() -> str | None:
    """The ``vllm-router`` script of this interpreter's environment, else the one on PATH, else None."""
    beside = Path(sys.executable).parent / "vllm-router"
    return str(beside) if beside.exists() else shutil.which("vllm-router")


def router_command(
    port: int,
    worker_urls: Sequence[str],
    policy: str = "consistent_hash",
    *,
    prometheus_port: int,
    binary: str | None = None,
    host: str = "127.0.0.1",
) -> list[str]:
    """vllm-router on ``host:port`` over ``worker_urls`` with ``policy``, the retry, breaker and health
    settings above, its Prometheus metrics on ``prometheus_port`` (it binds one in any case, 29000
    by default, which two routers on one machine would fight over)."""
    if policy not in POLICIES:
        raise ValueError(f"{policy=} is not one of {POLICIES}")
    binary = binary or router_binary()
    if binary is None:
        raise FileNotFoundError(
            "vllm-router is not installed: agentspec-decode's dev extra brings it (docs/install.md)"
        )
    return [
        binary,
        "--host", host,
        "--port", str(port),
        "--worker-urls", *worker_urls,
        "--policy", policy,
        "--prometheus-host", "127.0.0.1",
        "--prometheus-port", str(prometheus_port),
        "--retry-max-retries", str(RETRY_MAX_RETRIES),
        "--retry-initial-backoff-ms", str(RETRY_INITIAL_BACKOFF_MS),
        "--retry-max-backoff-ms", str(RETRY_MAX_BACKOFF_MS),
        "--cb-failure-threshold", str(CB_FAILURE_THRESHOLD),
        "--cb-timeout-duration-secs", str(CB_TIMEOUT_S),
        "--health-check-interval-secs", str(HEALTH_CHECK_INTERVAL_S),
        "--health-failure-threshold", str(HEALTH_FAILURE_THRESHOLD),
    ]  # fmt: skip


def session_choices(log_text: str) -> list[tuple[str, str]]:
    """(session id, worker URL) of every consistent-hash choice in a router's log, in order: every
    attempt of a request, so a retried request shows the dead worker and then the live one."""
    return [(m["session"], m["worker"]) for m in _CHOICE.finditer(log_text)]
