"""Output tokens' log-probabilities in OpenAI's shape (``choices[].logprobs.content``), for the server's
responses and chunks and ``ChatSpecDecode``'s ``response_metadata["logprobs"]``, as ChatOpenAI puts them.

Each entry is ``{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}``;
``token`` is the token's text as the tokenizer decodes it alone (a piece of a multi-byte character
decodes to U+FFFD, as in vLLM's responses), ``bytes`` its UTF-8 bytes. The end-of-sequence token
that ends a reply has no text in it and no entry, as in OpenAI's; a reply cut by a stop string has
entries for the tokens before the cut (``agentspec.decode`` trims the tokens with the text).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from agentspec.logprobs import TokenLogprob


class LogprobFormat:
    """One call's entries in OpenAI's shape: its tokenizer's token texts, memoised for the call."""

    def __init__(self, tokenizer: Any, eos: Collection[int]):
        self.tokenizer, self.eos = tokenizer, frozenset(eos)
        self._texts: dict[int, str] = {}

    def content(self, entries: list[TokenLogprob]) -> list[dict[str, Any]]:
        return [self._entry(e) for e in entries if e.token not in self.eos]

    def _entry(self, e: TokenLogprob) -> dict[str, Any]:
        top = [self._one(token, logprob) for token, logprob in e.top]
        return {**self._one(e.token, e.logprob), "top_logprobs": top}

    def _one(self, token: int, logprob: float) -> dict[str, Any]:
        text = self._text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _text(self, token: int) -> str:
        if token not in self._texts:
            self._texts[token] = self.tokenizer.decode([token])
        return self._texts[token]
