"""A drafter that keeps failing is rested: a cool-down across calls.

A drafter exception never changes an answer (the loop carries on with the target alone, see
``request._drop``), but a drafter that raises on every call still costs time on every call (a draft
model that runs out of memory, say). ``DraftHealth`` counts, per drafter chosen by name ("auto",
"model", ...: built afresh for each call; a Drafter instance passed in is left to its owner), the
calls in a row in which it failed; after ``threshold`` of them the next ``cooldown`` calls
decode without it (``DecodeStats.draft_cooldown`` names it), then it is tried again. A failure on
that retry doubles the cool-down, up to ``max_cooldown``; a call that drafts without failing
forgets the past failures.

A pair keeps one per namespace and one for itself (``agentspec.drafters.tenants.TenantStore``): an
out-of-memory failure is the pair's draft model's, any other only its namespace's.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class DraftHealth:
    threshold: int = 3  # calls in a row with a drafter failure before it is rested
    cooldown: int = 8  # calls decoded without it after the first trip
    max_cooldown: int = 256
    failing: dict[str, int] = field(default_factory=dict)  # name -> failing calls in a row
    resting: dict[str, int] = field(default_factory=dict)  # name -> calls left without it
    interval: dict[str, int] = field(default_factory=dict)  # name -> the cool-down of its next trip
    # Any: threading.Lock is a factory, not a type (pydantic, validating ChatSpecDecode.pair, warns)
    lock: Any = field(default_factory=threading.Lock, repr=False, compare=False)

    def allow(self, name: str) -> bool:
        """May this call use the drafter? (A call it sits out counts towards the cool-down.)"""
        with self.lock:
            left = self.resting.get(name, 0)
            if left > 0:
                self.resting[name] = left - 1
                return False
            return True

    def record(self, name: str, failed: bool) -> None:
        """The outcome of a call that used the drafter."""
        with self.lock:
            if not failed:
                self.failing.pop(name, None)
                self.interval.pop(name, None)
                return
            n = self.failing.get(name, 0) + 1
            self.failing[name] = n
            interval = self.interval.get(name, 0)
            if interval:  # failed again right after a cool-down: rest twice as long
                interval = min(2 * interval, self.max_cooldown)
            elif n >= self.threshold:
                interval = self.cooldown
            else:
                return
            self.interval[name], self.resting[name] = interval, interval
            log.warning(
                "drafter %s failed in %d calls in a row; the next %d calls decode with the target alone",
                name,
                n,
                interval,
            )
