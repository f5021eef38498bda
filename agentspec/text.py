"""Turning verified token ids into text that is safe to release.

Held back until more tokens arrive: a trailing incomplete UTF-8 character (the tokenizer decodes it
as U+FFFD) and any tail that could be the start of a stop string. Once a stop string appears, the
text ends right before it.
"""

from __future__ import annotations


def stop_cut(text: str, stops: tuple[str, ...], start: int = 0) -> int | None:
    """Index where the earliest stop string starts in text (at ``start`` or later), or None."""
    found = [i for i in (text.find(s, start) for s in stops) if i >= 0]
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
    """Decodes the output ids of one call incrementally and tracks what text has been released.

    Offset windows, as vLLM's incremental detokeniser: ``_text`` is the text of the first ``_read``
    kept ids (EOS ids are dropped), ending on a whole character; the text after it is the decode of
    the window ``ids[_prefix:]`` less the decode of ``ids[_prefix:_read]``, so a pass decodes a few
    tokens, not the whole output. The window starts one step back because a tokenizer may spell a
    token differently at the start of a text (SentencePiece drops its leading space). ``_read``
    moves up only when the text ends on a whole character (no trailing U+FFFD from a partial UTF-8
    sequence). Where the window's text does not start with its head's (a tokenizer that cleans up
    spaces across the seam), the whole output is decoded instead, so the text is always what
    ``decode`` of all the ids gives.
    """

    def __init__(self, tokenizer, stops: tuple[str, ...], skip_ids: set[int]):
        self.tokenizer = tokenizer
        self.stops = stops
        self.skip_ids = skip_ids  # EOS ids: never shown as text
        self.released = 0
        self._seen = 0  # how many output ids (EOS included) are in _ids
        self._ids: list[int] = []  # the kept output ids seen so far
        self._text = ""  # the text of _ids[:_read]
        self._prefix = self._read = 0
        self._head: str | None = None  # the text of _ids[_prefix:_read], decoded on first use

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([i for i in ids if i not in self.skip_ids])

    def text(self, ids: list[int]) -> str:
        """``decode(ids)``, from a window of the last tokens; ``ids`` extends those seen so far."""
        return self._window(ids)[1]

    def _window(self, ids: list[int]) -> tuple[list[int], str]:
        """(the kept ids of ``ids`` not seen yet, the text of all of ``ids``)."""
        assert len(ids) >= self._seen, f"{len(ids)=} {self._seen=}: the output only grows"
        new = [i for i in ids[self._seen :] if i not in self.skip_ids]
        if self._head is None:
            self._head = self.tokenizer.decode(self._ids[self._prefix : self._read])
        window = self.tokenizer.decode(self._ids[self._prefix :] + new)
        if not window.startswith(self._head):
            return new, self.tokenizer.decode(self._ids + new)
        return new, self._text + window[len(self._head) :]

    def _advance(self, ids: list[int]) -> str:
        """Take in ``ids`` (extending those seen so far) and return their text."""
        new, text = self._window(ids)
        self._ids += new
        self._seen = len(ids)
        if new and not text.endswith("\ufffd"):
            self._text, self._prefix, self._read, self._head = text, self._read, len(self._ids), None
        return text

    def first_stop(self, prev_ids: list[int], new_ids: list[int]) -> tuple[int, int] | None:
        """If a stop string completes within new_ids: (tokens of new_ids to keep, text cut index)."""
        # released text holds no stop string nor the start of one cut off at its end: a stop can
        # only start within the longest stop's length before it (a search bounded by new text)
        start = max(0, self.released - max(map(len, self.stops), default=0))
        if not self.stops or stop_cut(self.text(prev_ids + new_ids), self.stops, start) is None:
            return None
        for j in range(1, len(new_ids) + 1):  # the first token that completes a stop string
            cut = stop_cut(self.text(prev_ids + new_ids[:j]), self.stops, start)
            if cut is not None:
                return j, cut
        raise AssertionError("unreachable: the full decode contains a stop string")

    def release(self, ids: list[int], final: bool, cut: int | None = None) -> str:
        """Text newly safe to show after ``ids``; with final=True, everything that remains."""
        text = self._advance(ids)
        if cut is not None:
            end = cut
        elif final:
            end = len(text)
        else:
            end = safe_length(text, self.stops)
        delta = text[self.released : end] if end > self.released else ""
        self.released = max(self.released, end)
        return delta
