"""Grammar-constrained decoding: which tokens a grammar allows, along a speculative path.

The engine is xgrammar: its next-token masks cost far less than a target pass, and it gives
unlimited rollback, the forced continuation (jump-forward), structural tags (free text with
triggered tool-call blocks) and a kernel that applies its packed bitmask to the logits, which is
everything the decoding loop needs.

Three layers:

- ``Grammar``: a tokenizer-free grammar (JSON schema, tool calls, EBNF, regex). Building one
  validates it, so a schema the engine cannot handle fails where it is given (``bind_tools``,
  ``with_structured_output``), not in the middle of a decode.
- ``GrammarCompiler.compile(grammar)``: compiled against a tokenizer, once; each pair owns the
  compiler of its tokenizer (``ModelPair.grammar_compiler``), which caches compiled grammars by text.
- ``Constraint``: one call's position in a compiled grammar. The committed state is the verified
  output; on top of it a *path* of proposed tokens (jump-forward text, then the drafter's tokens)
  is pushed while the masks for the verify pass are computed, and ``commit(n)`` keeps the first
  ``n`` of them and rolls the rest back.

A verify pass's masks stay packed as xgrammar fills them (int32 [rows, ceil(V/32)], 1/8 of the bool
rows), go to the device in one non-blocking copy from pinned memory, and onto the logits through
xgrammar's own kernel (``apply_bitmask``); a drafter masking one row may use the bool form
(``allowed()``, ``apply_mask``).
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xgrammar as xgr
from xgrammar import structural_tag as st

# JSON written by a model may carry whitespace between tokens; an unbounded run of it is a known
# way for a small model to loop forever inside a constrained object, so runs are capped.
MAX_WHITESPACE = 8


class GrammarError(ValueError):
    """A grammar (JSON schema, tool schema, EBNF) that the grammar engine cannot use."""


@dataclass(frozen=True)
class Grammar:
    """A tokenizer-free grammar. ``key`` (the engine's normalised text) identifies it in caches."""

    grammar: Any  # xgrammar.Grammar
    key: str
    description: str

    def __repr__(self) -> str:
        return f"Grammar({self.description})"


def _build(make, description: str) -> Grammar:
    try:
        g = make()
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError/pydantic errors with details
        raise GrammarError(f"cannot build a grammar for {description}: {exc}") from exc
    return Grammar(g, str(g), description)


def _json_format(schema: Any) -> st.JSONSchemaFormat:
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"a JSON schema must be a dict, got {type(schema).__name__}")
    return st.JSONSchemaFormat(json_schema=schema, max_whitespace_cnt=MAX_WHITESPACE)


def json_schema(schema: dict | bool, name: str = "json_schema") -> Grammar:
    """The whole output is one JSON value valid under ``schema`` (cached by schema)."""
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"a JSON schema must be a dict, got {type(schema).__name__}")
    try:
        key = json.dumps(schema)  # not sorted: property order is part of the grammar
    except (TypeError, ValueError) as exc:
        raise GrammarError(f"JSON schema {name!r} is not JSON: {exc}") from exc
    return _json_schema(key, name)


@functools.lru_cache(maxsize=256)
def _json_schema(key: str, name: str) -> Grammar:
    def make():
        tag = st.StructuralTag(format=_json_format(json.loads(key)))
        return xgr.Grammar.from_structural_tag(tag)

    return _build(make, f"JSON schema {name!r}")


def json_object() -> Grammar:
    """Any JSON object (OpenAI's ``json_object`` response format)."""
    return json_schema({"type": "object"}, "json_object")


def ebnf(text: str, root: str = "root") -> Grammar:
    """A GBNF/EBNF grammar (llama.cpp's dialect)."""
    return _build(lambda: xgr.Grammar.from_ebnf(text, root_rule_name=root), "an EBNF grammar")


def regex(pattern: str) -> Grammar:
    return _build(lambda: xgr.Grammar.from_regex(pattern), f"regex {pattern!r}")


def call_delimiters(name: str, tool_format: str) -> tuple[str, str]:
    """Text before and after one call's arguments object, in the model's call format.

    "hermes" (Hermes, Qwen2.5, and the fallback prompt): ``<tool_call>\\n{"name": ..., "arguments":
    ARGS}\\n</tool_call>``. "json" (Llama 3.x): ``{"name": ..., "parameters": ARGS}``.
    """
    quoted = json.dumps(name, ensure_ascii=False)
    if tool_format == "json":
        return f'{{"name": {quoted}, "parameters": ', "}"
    return f'<tool_call>\n{{"name": {quoted}, "arguments": ', "}\n</tool_call>"


def tool_calls(
    tools: Sequence[dict],
    mode: str = "auto",
    *,
    tool_format: str = "hermes",
    single: bool = False,
    answer: dict | None = None,
) -> Grammar:
    """Tool calls to ``tools`` (OpenAI-format dicts), each one's arguments valid under its schema.

    mode "any": the reply is one or more calls and nothing else. mode "auto": the model may also
    answer instead; the answer is free text in which any ``<tool_call>`` the model opens must be a
    valid call, or, with ``answer`` (a JSON schema), a JSON value valid under it. ``single``: at
    most one call, then the end of the output. In "json" format (Llama 3.x) calls have no tag to
    open, so "auto" without ``answer`` leaves the output free (calls are only parsed).
    Grammars are cached by their arguments: an agent's tool set is built once.
    """
    if mode not in ("auto", "any"):
        raise ValueError(f"mode: expected 'auto' or 'any', got {mode!r}")
    if not tools:
        raise GrammarError("tool calls need at least one tool")
    try:
        key = json.dumps([list(tools), mode, tool_format, single, answer], default=str)  # order matters
    except (TypeError, ValueError) as exc:
        raise GrammarError(f"tool schemas must be JSON: {exc}") from exc
    return _tool_calls(key)


@functools.lru_cache(maxsize=256)
def _tool_calls(key: str) -> Grammar:
    tools, mode, tool_format, single, answer = json.loads(key)
    tags, names = [], []
    for tool in tools:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise GrammarError(f"a tool has no name: {tool!r}")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        begin, end = call_delimiters(name, tool_format)
        try:  # each tool alone first, so that an error names the tool at fault
            tag = st.TagFormat(begin=begin, content=_json_format(params), end=end)
            xgr.Grammar.from_structural_tag(st.StructuralTag(format=tag))
        except Exception as exc:
            raise GrammarError(f"tool {name!r}: its parameters schema cannot be used: {exc}") from exc
        tags.append(tag)
        names.append(name)
    sep = "\n" if tool_format != "json" else "; "
    calls = st.TagsWithSeparatorFormat(tags=tags, separator=sep, at_least_one=True, stop_after_first=single)

    def make():
        if mode == "any":
            fmt = calls
        elif answer is not None:
            fmt = st.OrFormat(elements=[calls, _json_format(answer)])
        elif tool_format != "json":
            fmt = st.TriggeredTagsFormat(triggers=["<tool_call>"], tags=tags, stop_after_first=single)
        else:
            fmt = st.AnyTextFormat()
        return xgr.Grammar.from_structural_tag(st.StructuralTag(format=fmt))

    return _build(make, f"tool calls ({mode}) to {', '.join(names)}")


# -- compiling against a tokenizer -------------------------------------------------------------------


class GrammarCompiler:
    """One tokenizer's xgrammar compiler, built on first use, and its compiled grammars (LRU by text).

    Owned by the ``ModelPair`` whose tokenizer it reads (``ModelPair.grammar_compiler``).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos: Iterable[int], capacity: int = 64):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos = sorted(eos)
        self.capacity = capacity
        self.compiled: OrderedDict[str, Any] = OrderedDict()
        self.lock = threading.Lock()
        self._compiler: Any = None  # xgrammar.GrammarCompiler: reading a vocabulary takes a while

    def _xgrammar(self):
        with self.lock:
            if self._compiler is None:
                self._compiler = xgr.GrammarCompiler(self._tokenizer_info(), max_threads=1)
            return self._compiler

    def prepare(self) -> None:
        """Read the vocabulary now (``agentspec.warm``'s thread at load), not in the first
        constrained call; a compile meanwhile waits for it."""
        self._xgrammar()

    def _tokenizer_info(self):
        try:
            return xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos
            )
        except Exception:
            # Not a transformers tokenizer (tests use a fake one): read the vocabulary by decoding
            # each id on its own. Fine for tokenizers whose pieces are whole characters.
            vocab = [self.tokenizer.decode([i]) for i in range(self.vocab_size)]
            return xgr.TokenizerInfo(
                vocab, xgr.VocabType.RAW, vocab_size=self.vocab_size, stop_token_ids=self.eos
            )

    def compile(self, grammar: Grammar):
        """``grammar`` compiled for this tokenizer (cached: the same grammar compiles once)."""
        with self.lock:
            hit = self.compiled.get(grammar.key)
            if hit is not None:
                self.compiled.move_to_end(grammar.key)
                return hit
        try:
            compiled = self._xgrammar().compile_grammar(grammar.grammar)
        except Exception as exc:
            raise GrammarError(f"cannot compile {grammar.description} for this tokenizer: {exc}") from exc
        with self.lock:
            self.compiled[grammar.key] = compiled
            while len(self.compiled) > self.capacity:
                self.compiled.popitem(last=False)
        return compiled


# -- masks -------------------------------------------------------------------------------------------

_SHIFTS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's packed int32 bitmask [..., ceil(V/32)] -> bool [..., V] (True: allowed)."""
    bits = (bitmask.unsqueeze(-1) >> _SHIFTS.to(bitmask.device)) & 1
    return bits.flatten(-2)[..., :vocab_size].bool()


def apply_mask(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Logits [..., V] with disallowed tokens at -inf (a new tensor; the input is left alone)."""
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Logits [rows, V] with the tokens a packed bitmask [rows, ceil(V/32)] forbids at -inf.

    ``apply_mask`` with the masks still packed: xgrammar's own kernel, on the logits' device. A new
    tensor; the input is left alone.
    """
    words = -(-logits.shape[-1] // 32)
    assert bitmask.shape[-1] == words, f"{bitmask.shape=} {logits.shape=}"
    out = logits.clone()
    # from pinned memory (``Constraint.bitmasks``) this copy is queued, not waited for
    mask = bitmask.to(out.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(out, mask, vocab_size=out.shape[-1])
    return out


class Constraint:
    """One call's state in a compiled grammar, with a speculative path on top.

    ``allowed()`` is the mask after the committed tokens and the path; ``push(t)`` extends the path
    (False, and nothing changes, if the grammar forbids ``t``); ``commit(n)`` keeps the path's
    first ``n`` tokens as verified output and rolls back the rest. ``masks(rows)`` gives the masks
    at path positions 0..rows-1 for a verify pass; positions past the end of the path (after a
    token the grammar rejects, which verification rejects too) are left unmasked.
    """

    def __init__(self, compiled: Any, vocab_size: int):
        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self.path: list[int] = []
        # _rows[i]: the packed mask [ceil(V/32)] before path token i (computed lazily)
        self._rows: list[torch.Tensor] = []
        # the bits of real tokens: xgrammar's words hold 32 ids, the last one may run past V
        self._real = torch.full((-(-vocab_size // 32),), -1, dtype=torch.int32)
        if vocab_size % 32:
            self._real[-1] = (1 << vocab_size % 32) - 1

    @classmethod
    def for_pair(cls, pair: Any, grammar: Grammar) -> Constraint:
        compiler = pair.grammar_compiler
        return cls(compiler.compile(grammar), compiler.vocab_size)

    @property
    def terminated(self) -> bool:
        """The grammar accepted a stop token: nothing may follow."""
        return self.matcher.is_terminated()

    def bitmask(self) -> torch.Tensor:
        """int32 [ceil(V/32)]: ``allowed()`` packed as xgrammar fills it (bit t % 32 of word t // 32)."""
        depth = len(self.path)
        if len(self._rows) > depth:
            return self._rows[depth]
        row = xgr.allocate_token_bitmask(1, self.vocab_size)
        if self.matcher.is_terminated():  # after a stop token nothing is allowed
            row.zero_()
        else:
            self.matcher.fill_next_token_bitmask(row)
        self._rows.append(row[0])
        return row[0]

    def allowed(self) -> torch.Tensor:
        """bool [V]: the tokens the grammar allows after the committed tokens and the path."""
        return unpack_bitmask(self.bitmask(), self.vocab_size)

    def push(self, token: int) -> bool:
        if self.matcher.is_terminated() or not (int(self.bitmask()[token >> 5]) >> (token & 31)) & 1:
            return False
        if not self.matcher.accept_token(token):
            return False
        self.path.append(token)
        return True

    def bitmasks(self, rows: int) -> torch.Tensor:
        """int32 [rows, ceil(V/32)]: the packed mask at each of the path's first ``rows`` positions,
        for ``apply_bitmask``.

        In pinned host memory where CUDA is present, so that one non-blocking copy takes the
        pass's masks to the device (PyTorch's caching host allocator keeps a pinned block until
        the copies queued from it have run, so a fresh tensor per pass is safe and cheap). The
        loop fills them after queueing the target's pass: on a GPU they are computed while it runs.
        """
        out = torch.empty((rows, len(self._real)), dtype=torch.int32, pin_memory=torch.cuda.is_available())
        out.fill_(-1)
        for i in range(min(rows, len(self.path) + 1)):  # push() filled the rows of the path
            out[i] = self._rows[i] if i < len(self.path) else self.bitmask()
        # a row with nothing allowed follows a stop token: never used, but it must not turn into NaN
        out[((out & self._real) == 0).all(dim=-1)] = -1
        return out

    def masks(self, rows: int) -> torch.Tensor:
        """bool [rows, V]: ``bitmasks(rows)`` unpacked."""
        return unpack_bitmask(self.bitmasks(rows), self.vocab_size)

    def rewind(self, depth: int) -> None:
        """Drop the path after its first ``depth`` tokens."""
        extra = len(self.path) - depth
        if extra > 0:
            self.matcher.rollback(extra)
            del self.path[depth:]
        del self._rows[depth + 1 :]

    def commit(self, n: int) -> None:
        """The path's first ``n`` tokens are verified output; roll the rest back."""
        self.rewind(n)
        self.path = []
        self._rows = self._rows[n : n + 1]

    def accept_text(self, text: str) -> bool:
        """Commit text already written into the reply (a forced prefix); False if it does not fit."""
        assert not self.path, "accept_text() extends the committed state"
        self._rows = []
        return not text or bool(self.matcher.accept_string(text))

    def forced(self) -> int | None:
        """The only token the grammar allows next (with an empty path), or None."""
        assert not self.path, "forced() reads the committed state"
        if self.matcher.is_terminated():
            return None
        words = self.bitmask() & self._real  # packed, read as is: no [V] bool row per pass
        set_words = words.nonzero()
        if len(set_words) != 1:
            return None
        i = int(set_words[0, 0])
        word = int(words[i]) & 0xFFFFFFFF  # the int32 word's 32 bits, bit 31 included
        if word & (word - 1):  # more than one bit: more than one token
            return None
        return 32 * i + word.bit_length() - 1

    def take_forced(self, limit: int) -> list[int]:
        """Commit the run of tokens the grammar alone allows next (at most ``limit``) and return it."""
        out: list[int] = []
        while len(out) < limit and (token := self.forced()) is not None:
            self.push(token)
            self.commit(1)
            out.append(token)
        return out

    def push_jump_forward(self, limit: int) -> list[int]:
        """Push tokens spelling the text the grammar forces next (at most ``limit``) onto the empty
        path, and return them: a draft to verify. The tokenisation is xgrammar's longest-match,
        which the model may not share; verification decides."""
        assert not self.path, "push_jump_forward() starts from the committed state"
        if limit <= 0 or self.matcher.is_terminated():
            return []
        pushed: list[int] = []
        for token in self.matcher.find_jump_forward_tokens()[:limit]:
            if not self.push(token):
                break
            pushed.append(token)
        return pushed
