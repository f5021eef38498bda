"""Turning verified token ids into text that is safe to release.

Held back until more tokens arrive: a trailing incomplete UTF-8 character (the tokenizer decodes it
as U+FFFD) and any tail that could be the start of a stop string. Once a stop string appears, the
text ends right before it.
"""

from __future__ import annotations


def stop_cut(text: str, stops: tuple[str, ...]) -> int | None:
    """Index where the earliest stop string starts in text, or None."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def safe_length(text: str, stops: tuple[str, ...]) -> int:
    """How much of text can be released now (no partial character, no partial stop string)."""
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    hold = 0
    for s in stops:
        for j in range(min(len(s) - 1, end), 0, -1):  # longest tail that starts stop string s
            if text[end - j : end] == s[:j]:
                hold = max(hold, j)
                break
    return end - hold


class TextTracker:
    """Decodes the output ids of one call and tracks what text has been released."""

    def __init__(self, tokenizer, stops: tuple[str, ...], skip_ids: set[int]):
        self.tokenizer = tokenizer
        self.stops = stops
        self.skip_ids = skip_ids  # EOS ids: never shown as text
        self.released = 0

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([i for i in ids if i not in self.skip_ids])

    def first_stop(self, prev_ids: list[int], new_ids: list[int]) -> tuple[int, int] | None:
        """If a stop string completes within new_ids: (tokens of new_ids to keep, text cut index)."""
        if not self.stops or stop_cut(self.decode(prev_ids + new_ids), self.stops) is None:
            return None
        for j in range(1, len(new_ids) + 1):  # the first token that completes a stop string
            cut = stop_cut(self.decode(prev_ids + new_ids[:j]), self.stops)
            if cut is not None:
                return j, cut
        raise AssertionError("unreachable: the full decode contains a stop string")

    def release(self, ids: list[int], final: bool, cut: int | None = None) -> str:
        """Text newly safe to show after ``ids``; with final=True, everything that remains."""
        text = self.decode(ids)
        if cut is not None:
            end = cut
        elif final:
            end = len(text)
        else:
            end = safe_length(text, self.stops)
        delta = text[self.released : end] if end > self.released else ""
        self.released = max(self.released, end)
        return delta
