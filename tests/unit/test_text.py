"""agentspec.text: where stop strings cut, what text is safe to release, and stops inside a pass."""

from __future__ import annotations

import random

import pytest

import agentspec
from agentspec.text import TextTracker, safe_length, stop_cut

# --- stop_cut ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "stops", "want"),
    [
        ("hello world", ("world",), 6),
        ("hello world", ("xyz",), None),
        ("hello world", (), None),
        ("a STOP b END", ("END", "STOP"), 2),  # the earliest in the text, not in the tuple
        ("abcabc", ("bc",), 1),  # the first occurrence
        ("Observation: x", ("Observation:", "Obs"), 0),  # overlapping stops start at the same place
    ],
)
def test_stop_cut(text, stops, want):
    assert stop_cut(text, stops) == want


# --- safe_length ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "stops", "want"),
    [
        ("hello", (), 5),
        ("", ("stop",), 0),
        ("hello wor", ("world",), 6),  # "wor" may become "world": held back
        ("hello w", ("world",), 6),
        ("hello x", ("world",), 7),  # "x" starts no stop string
        ("answer: <|e", ("<|end|>",), 8),
        ("say Obs", ("Observation:", "Obs!"), 4),  # the longer hold of two stop strings
        ("abc\n", ("\n",), 4),  # a one-character stop is never partial: stop_cut's job
        ("caf\ufffd", (), 3),  # an incomplete UTF-8 character decodes to U+FFFD: held back
        ("caf\ufffd\ufffd", (), 3),
        ("a\ufffdb", (), 3),  # only a trailing U+FFFD is pending
        ("x <|\ufffd", ("<|end|>",), 2),  # both: drop the U+FFFD, then hold the partial "<|"
        ("\ufffd", ("a",), 0),
    ],
)
def test_safe_length(text, stops, want):
    assert safe_length(text, stops) == want


def test_safe_length_never_releases_the_start_of_a_stop_string():
    stop = "END!"
    text = "the END!"
    released = 0
    for i in range(len(text) + 1):
        prefix = text[:i]
        if stop_cut(prefix, (stop,)) is not None:
            break
        released = max(released, safe_length(prefix, (stop,)))
        assert released <= text.index(stop), f"{prefix=} {released=}"


# --- TextTracker ---------------------------------------------------------------------------------


class WordTokenizer:
    eos_token_id = 0

    def __init__(self):
        self.pieces = ["<eos>", "Hello", " Wor", "ld", "!", " ", "caf", "\ufffd", "é"]

    def decode(self, ids, **_):
        return "".join(self.pieces[i] for i in ids)


def test_first_stop_finds_the_token_that_completes_the_stop():
    tracker = TextTracker(WordTokenizer(), ("World",), skip_ids={0})
    # prev "Hello", new " Wor" "ld" "!": the stop completes with the second new token
    assert tracker.first_stop([1], [2, 3, 4]) == (2, len("Hello "))
    assert tracker.first_stop([1], [2]) is None
    assert tracker.first_stop([1, 2], [3]) == (1, 6)  # the stop spans the previous pass


def test_first_stop_without_stops_or_matches():
    assert TextTracker(WordTokenizer(), (), skip_ids=set()).first_stop([1], [2, 3]) is None
    assert TextTracker(WordTokenizer(), ("xyz",), skip_ids=set()).first_stop([1], [2, 3]) is None


def test_eos_is_never_text():
    tracker = TextTracker(WordTokenizer(), ("<eos>",), skip_ids={0})
    assert tracker.decode([1, 0]) == "Hello"
    assert tracker.first_stop([1], [0]) is None  # the EOS id has no text: it cannot match


def test_release_holds_back_and_then_flushes():
    tracker = TextTracker(WordTokenizer(), ("World",), skip_ids={0})
    assert tracker.release([1], final=False) == "Hello"
    assert tracker.release([1, 2], final=False) == " "  # "Wor" could start "World": held
    assert tracker.release([1, 2, 4], final=False) == "Wor!"
    assert tracker.release([1, 2, 4, 6, 7], final=False) == "caf"  # U+FFFD held
    assert tracker.release([1, 2, 4, 6, 7], final=True) == "\ufffd"  # final: everything left


def test_release_cuts_at_a_stop():
    tracker = TextTracker(WordTokenizer(), ("World",), skip_ids={0})
    ids = [1, 2, 3, 4]
    hit = tracker.first_stop([1], [2, 3, 4])
    assert hit == (2, 6)
    assert tracker.release(ids[:3], final=True, cut=hit[1]) == "Hello "


# --- incremental decoding: the same text as decoding everything, from a window of the last tokens --


class ByteTokenizer:
    """Byte-level BPE's decode (GPT-2, SmolLM2): pieces are bytes, joined, then read as UTF-8."""

    pieces = [
        b"<eos>",
        b"a",
        b" b",
        b"\xc3",
        b"\xa9",
        b"\xe2\x98",
        b"\x83",
        b"\xf0\x9f",
        b"\x98\x80",
        b" .",
        b"!",
        b" ",
        b".",
    ]

    def __init__(self):
        self.calls: list[int] = []  # how many ids each decode read

    def decode(self, ids, **_):
        self.calls.append(len(ids))
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


class SpaceTokenizer(ByteTokenizer):
    """SentencePiece's decode: the leading space of the first piece is dropped."""

    def decode(self, ids, **_):
        text = super().decode(ids)
        return text[1:] if text.startswith(" ") else text


class CleanupTokenizer(ByteTokenizer):
    """transformers' ``clean_up_tokenization_spaces``: " ." -> "." wherever it appears."""

    def decode(self, ids, **_):
        return super().decode(ids).replace(" .", ".")


class WholeTracker:
    """The tracker as it was: every pass decodes the whole output."""

    def __init__(self, tokenizer, stops, skip_ids):
        self.decode = lambda ids: tokenizer.decode([i for i in ids if i not in skip_ids])
        self.stops, self.released = stops, 0

    def first_stop(self, prev_ids, new_ids):
        if not self.stops or stop_cut(self.decode(prev_ids + new_ids), self.stops) is None:
            return None
        j = next(
            j
            for j in range(1, len(new_ids) + 1)
            if stop_cut(self.decode(prev_ids + new_ids[:j]), self.stops) is not None
        )
        return j, stop_cut(self.decode(prev_ids + new_ids[:j]), self.stops)

    def release(self, ids, final, cut=None):
        text = self.decode(ids)
        end = cut if cut is not None else len(text) if final else safe_length(text, self.stops)
        delta = text[self.released : end] if end > self.released else ""
        self.released = max(self.released, end)
        return delta


def run_passes(tracker, passes: list[list[int]]) -> list[tuple]:
    """What the decoding loop does with a tracker, pass by pass: (stop hit, released text)."""
    out: list[int] = []
    seen = []
    for i, new in enumerate(passes):
        hit = tracker.first_stop(out, new)
        out += new[: hit[0]] if hit else new
        final = hit is not None or i == len(passes) - 1
        seen.append((hit, tracker.release(out, final, hit[1] if hit else None)))
        if final:
            break
    return seen


@pytest.mark.parametrize("kind", [ByteTokenizer, SpaceTokenizer, CleanupTokenizer])
@pytest.mark.parametrize("stops", [(), ("b.",), ("\u2603 b", "a!")])
@pytest.mark.parametrize("seed", range(40))
def test_windowed_text_is_the_whole_decode(kind, stops, seed):
    rng = random.Random(seed)
    ids = [rng.randrange(1, len(ByteTokenizer.pieces)) for _ in range(rng.randrange(1, 40))] + [0]
    cuts = sorted(rng.sample(range(1, len(ids)), min(len(ids) - 1, rng.randrange(0, 8))))
    passes = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True)]
    want = run_passes(WholeTracker(kind(), stops, {0}), passes)
    assert run_passes(TextTracker(kind(), stops, {0}), passes) == want, f"{passes=}"


def test_a_pass_decodes_a_window_not_the_output():
    tok = ByteTokenizer()
    tracker = TextTracker(tok, (), {0})
    out: list[int] = []
    for _ in range(50):
        out += [1, 2, 3, 4]  # "a b" then "é" in two pieces
        tok.calls.clear()
        assert tracker.release(out, final=False) == "a b\u00e9"
        assert max(tok.calls) <= 8, f"{tok.calls=}"  # this pass and the one before


def test_a_cleanup_across_the_seam_decodes_the_whole_output():
    # "a b" + " " then "." : the tokenizer turns " ." into "." only once both are there
    passes = [[1, 2, 11], [12, 1]]
    tracker = TextTracker(CleanupTokenizer(), (), {0})
    assert run_passes(tracker, passes) == run_passes(WholeTracker(CleanupTokenizer(), (), {0}), passes)
    assert tracker.text([1, 2, 11, 12, 1]) == "a b.a"


def test_a_partial_character_waits_for_its_end():
    tracker = TextTracker(ByteTokenizer(), (), {0})
    assert tracker.release([1, 5], final=False) == "a"  # the snowman's first two bytes: U+FFFD held
    assert tracker.text([1, 5]) == "a\ufffd"
    assert tracker.release([1, 5, 6], final=False) == "\u2603"
    assert tracker.release([1, 5, 6, 7, 8, 0], final=True) == "\U0001f600"


# --- stop strings through the decoding loop ------------------------------------------------------


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("drafter", ["none", "prompt_lookup", "model"])
def test_generate_stops_before_a_stop_string(pair, tokenizer, hf_greedy, drafter):
    prompt = [3, 17, 42, 5, 9, 3, 17]
    ref = hf_greedy(pair.target, prompt, 20)
    stop = tokenizer.decode(ref[6:8])  # two generated tokens' text
    full = tokenizer.decode(ref)
    want_text = full[: stop_cut(full, (stop,))]
    want_ids = next(ref[:j] for j in range(1, len(ref) + 1) if stop in tokenizer.decode(ref[:j]))
    result = agentspec.generate(
        pair, prompt, drafter=drafter, max_new_tokens=20, num_draft_tokens=4, stop=stop
    )
    assert result.finish_reason == "stop"
    assert result.text == want_text
    assert result.token_ids == want_ids  # kept up to the token that completes the stop string
    assert result.stats.output_tokens == len(want_ids)


@pytest.mark.usefixtures("one_thread")
def test_streamed_text_never_shows_a_partial_stop(pair, tokenizer, hf_greedy):
    prompt = [8, 1, 30, 8, 1]
    ref = hf_greedy(pair.target, prompt, 16)
    stop = tokenizer.decode(ref[9:11]) + "never-there"  # starts inside the output, never completes
    ids, shown, held = [], "", False
    for step in agentspec.stream(pair, prompt, drafter="model", max_new_tokens=16, stop=stop):
        ids += step.tokens
        shown += step.text
        text = tokenizer.decode(ids)
        if step.finish_reason is None:
            assert shown == text[: safe_length(text, (stop,))], f"{shown=} {text=}"
            held = held or len(shown) < len(text)
    assert held  # the test did exercise a held-back tail
    assert ids == ref
    assert shown == tokenizer.decode(ref)  # finish_reason "length" flushes the held tail
