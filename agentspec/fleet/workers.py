"""The fleet's workers: each ``agentspec serve`` on a free loopback port, pinned to its share of the CPUs.

A worker gets ``--threads`` (torch's intra-op threads) and, where ``taskset`` exists, the CPUs of its
share as its affinity from the start: set before the interpreter starts, every thread torch and
OpenMP create later inherits it (``os.sched_setaffinity`` on a running server would move only the
thread it names). Without ``taskset`` the workers keep the thread count and the OS places them.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from agentspec.fleet.process import ServerProcess, agentspec_serve_command, checkout_env, free_port
from agentspec.fleet.router import router_command, session_choices

# requests a fleet worker queues behind the one decoding: deep, since a 503 from a full queue counts
# against the worker's circuit breaker in the router (agentspec.fleet.router)
WORKER_QUEUE_SIZE = 32


def cpu_shares(n_workers: int, cpus: Sequence[int] | None = None) -> list[tuple[int, ...]]:
    """``cpus`` (default: those this process may run on) cut into ``n_workers`` contiguous shares as
    even as can be; with more workers than CPUs, workers share a CPU round-robin."""
    assert n_workers >= 1, f"{n_workers=}"
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if n_workers >= len(cpus):
        return [(cpus[i % len(cpus)],) for i in range(n_workers)]
    size, extra = divmod(len(cpus), n_workers)
    shares, start = [], 0
    for i in range(n_workers):
        end = start + size + (i < extra)
        shares.append(tuple(cpus[start:end]))
        start = end
    return shares


def pinned(command: Sequence[str], cpus: Sequence[int]) -> list[str]:
    """``command`` run on ``cpus`` only (``taskset -c``), or as it is where ``taskset`` is missing."""
    taskset = shutil.which("taskset")
    return [taskset, "-c", ",".join(map(str, cpus)), *command] if taskset else list(command)


def agentspec_worker(
    cpus: Sequence[int],
    *,
    threads: int | None = None,
    options: Sequence[str] = (),
    log: Path | None = None,
    env: dict[str, str] | None = None,
) -> ServerProcess:
    """An ``agentspec serve`` (not started) on a free port with ``threads`` torch threads (default: one
    per CPU of its share), pinned to ``cpus``; ``options`` are more ``agentspec serve`` flags."""
    port = free_port()
    threads = len(cpus) if threads is None else threads
    command = agentspec_serve_command(port, "--threads", str(threads), *options)
    return ServerProcess(pinned(command, cpus), port, env=checkout_env(env), log=log)


def start_all(processes: Sequence[ServerProcess]) -> None:
    """Start ``processes`` at once (each loads its own model: the loads overlap); if one fails, stop
    every one and raise the first failure."""
    with ThreadPoolExecutor(max(1, len(processes))) as pool:
        futures = [pool.submit(p.start) for p in processes]
        errors = [f.exception() for f in futures]
    failed = [e for e in errors if e is not None]
    if failed:
        for p in processes:
            p.stop()
        raise failed[0]


class Fleet:
    """``n_workers`` ``agentspec serve`` workers behind vllm-router on 127.0.0.1; a context manager.

    Each worker runs on its share of this process's CPUs (``cpu_shares``) with ``threads_per_worker``
    torch threads (default: one per CPU of its share); the workers load at once, then the router
    starts in front of them on ``port`` (default: a free one) with ``policy``. ``url`` is the
    router's, the fleet's one address; ``workers`` are the workers' URLs in order. ``api_keys`` go to
    every worker (the router passes the caller's ``Authorization`` through); ``worker_options`` are
    more ``agentspec serve`` flags. Logs go to ``log_dir`` (``router.log``, ``worker-<i>.log``), or
    to temporary files. Leaving the block stops the router and every worker.
    """

    def __init__(
        self,
        n_workers: int = 2,
        *,
        port: int | None = None,
        policy: str = "consistent_hash",
        threads_per_worker: int | None = None,
        api_keys: Sequence[str] = (),
        worker_options: Sequence[str] = (),
        log_dir: Path | None = None,
    ):
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
        # the fleet's queue size first: one in worker_options comes later and wins (argparse)
        options = [
            "--queue-size",
            str(WORKER_QUEUE_SIZE),
            *worker_options,
            *(f for key in api_keys for f in ("--api-key", key)),
        ]
        self.cpus = cpu_shares(n_workers)  # each worker's CPUs, in order
        self.processes = [
            agentspec_worker(
                cpus,
                threads=threads_per_worker,
                options=options,
                log=None if log_dir is None else log_dir / f"worker-{i}.log",
            )
            for i, cpus in enumerate(self.cpus)
        ]
        port = free_port() if port is None else port
        command = router_command(port, self.workers, policy, prometheus_port=free_port())
        self.router = ServerProcess(command, port, log=None if log_dir is None else log_dir / "router.log")
        self.policy = policy

    @property
    def url(self) -> str:
        return self.router.url

    @property
    def workers(self) -> list[str]:
        return [p.url for p in self.processes]

    def start(self) -> Fleet:
        try:
            start_all(self.processes)
            self.router.start()
        except BaseException:  # a failed start, or Ctrl-C during the loads: leave nothing running
            self.stop()
            raise
        return self

    def stop_worker(self, i: int, kill: bool = True) -> None:
        """Stop worker ``i`` (SIGKILL with ``kill``: a crash, for the fault tests); the router keeps it
        on its list and routes around it."""
        self.processes[i].stop(kill=kill)

    def session_choices(self) -> list[tuple[str, str]]:
        """(session id, worker URL) of every consistent-hash choice the router made so far, in order."""
        return session_choices(self.router.log.read_text(errors="replace"))

    def stop(self) -> None:
        self.router.stop()
        for p in self.processes:
            p.stop()

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
