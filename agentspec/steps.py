"""Drafting as steps: a drafter's model passes, yielded to whoever runs them.

A drafter that runs a model (a draft model, an EAGLE head, a DFlash or DSpark block head) proposes
through a generator (``Drafter.propose_steps``): each forward of its model is a ``Job`` it yields,
and the job's result (or its error, raised at the ``yield``) is what it is sent back. Alone, the
jobs run one by one (``run_alone``); in a shared pass, the scheduler advances every call's generator
in lockstep in its one thread and runs the jobs of one model together, as one packed forward
(``agentspec.packed.DraftRound``): a drafter takes one forward per draft position for all the calls,
with no drafting threads and no barrier. Python's generators are the stackful step this needs: the
jobs come from deep inside each drafter's own loop (its schedule, its grammar, its draws), which
stays written as a plain loop.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

T = TypeVar("T")


@dataclass
class Job:
    """One forward a drafter asks for. ``key``: jobs of one key may run as one pass (the model they
    run; ``together`` computes all their results, in their order, from one pass); ``alone`` runs it
    by itself (where it is the only one, the key has no ``together``, or the pass together fails).
    ``payload``: what ``together`` reads of each job."""

    key: Any
    alone: Callable[[], Any]
    together: Callable[[list[Job]], list] | None = None
    payload: Any = None
    out: Any = None
    error: BaseException | None = None


# a drafter's steps: yields Jobs, is sent each one's result, returns what it drafted
Steps = Generator[Job, Any, T]


def run_alone(steps: Steps[T]) -> T:
    """What ``steps`` returns, each of its jobs run by itself, as a model's forward runs (in inference
    mode), its error raised in ``steps``."""
    got = advance(steps, None)
    while isinstance(got, Job):
        try:
            with torch.inference_mode():
                got.out = got.alone()
        except Exception as exc:
            got.error = exc
        got = advance(steps, got)
    return got


def advance(steps: Steps[T], job: Job | None) -> Job | T:
    """``steps`` moved on past ``job`` (None: started): its next job, or what it returned. A
    ``Job`` returned as a drafter's result would be read as a step: none returns one."""
    try:
        if job is None:
            return next(steps)
        if job.error is not None:
            return steps.throw(job.error)
        return steps.send(job.out)
    except StopIteration as stop:
        return stop.value
