"""Grammar-constrained decoding composed with speculation: lossless, valid, and faster where forced.

The reference for greedy output is plain constrained decoding written here with xgrammar alone (a
fresh matcher, its own bitmask kernel, one uncached forward pass per token): the speculative loop
must reproduce it token for token, with every drafter, with and without jump-forward. Sampling is
checked like ``test_sampling_lossless``: the exact distribution of the first 3 tokens under the
grammar-masked target against many seeded runs, by a chi-square test; one drafter there samples
without the mask, so grammar-invalid draft tokens with a real q go through rejection.

The tiny models' vocabulary has multi-character pieces ("12", "[1", ",2", "ab") so that a text has
several tokenisations, as with real BPE vocabularies.
"""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr
from test_sampling_lossless import chi_square

import agentspec
from agentspec import Draft, ModelPair
from agentspec import grammar as G
from agentspec.drafters import Drafter, ModelDrafter
from agentspec.sampling import probabilities

pytestmark = pytest.mark.usefixtures("one_thread")

# 16 pieces the grammars use; the 64-token models fill the rest with pieces no grammar allows
PIECES = ["[", "0", "1", "2", ",", "12", "[1", ",2", "20", "]", "a", "b", "ab", "c", "x", "<e>"]
LIST = 'root ::= "[" num ("," num)*\nnum ::= [0-2]+'  # never complete: any length is valid
FORCED = 'root ::= "abc" [0-2] [0-2] "]" "abc" [0-2]+'  # long forced stretches between choices
EOS = 15  # "<e>", the end-of-sequence token of the EOS pair


def pieces(vocab: int) -> list[str]:
    return PIECES + [f"q{i}" for i in range(vocab - len(PIECES))]


@pytest.fixture(scope="module")
def gpair(one_thread, tiny_llama, perturbed, fake_tokenizer) -> ModelPair:
    target = tiny_llama(3, logit_scale=4.0)
    draft = perturbed(target, seed=4, noise=0.1)
    return ModelPair(target=target, draft=draft, tokenizer=fake_tokenizer(pieces=pieces(64)), name="g")


@pytest.fixture(scope="module")
def eos_pair(gpair, fake_tokenizer) -> ModelPair:
    tok = fake_tokenizer(pieces=pieces(64), eos_token_id=EOS)
    return ModelPair(target=gpair.target, draft=gpair.draft, tokenizer=tok, name="g-eos")


@torch.inference_mode()
def reference(pair: ModelPair, prompt: list[int], grammar: G.Grammar, n: int) -> list[int]:
    """Plain constrained greedy decoding, written with xgrammar only."""
    vocab = pair.target.config.vocab_size
    matcher = xgr.GrammarMatcher(pair.grammar_compiler.compile(grammar))
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    out: list[int] = []
    while len(out) < n and not matcher.is_terminated():
        logits = pair.target(input_ids=torch.tensor([prompt + out])).logits[:, -1].float()  # [1, V]
        matcher.fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        token = int(logits.argmax())
        assert matcher.accept_token(token)
        out.append(token)
    return out


def valid_prefix(pair: ModelPair, grammar: G.Grammar, tokens: list[int]) -> bool:
    c = G.Constraint.for_pair(pair, grammar)
    return all(c.push(t) for t in tokens)


PROMPTS = [[1, 2, 3, 4], [20, 21, 22, 1, 2, 3, 4, 5, 6], [9, 9, 9, 9, 9, 9, 9, 9]]


@pytest.mark.parametrize("drafter", ["model", "prompt_lookup", "none"])
@pytest.mark.parametrize("jump_forward", [True, False])
@pytest.mark.parametrize("source", ["LIST", "FORCED"])
def test_greedy_constrained_equals_plain_constrained(gpair, drafter, jump_forward, source):
    grammar = G.ebnf(globals()[source])
    for prompt in PROMPTS:
        expected = reference(gpair, prompt, grammar, 24)
        r = agentspec.generate(
            gpair, prompt, drafter, prefix_cache=False, grammar=grammar, max_new_tokens=24,
            jump_forward=jump_forward, num_draft_tokens=3,
        )  # fmt: skip
        assert r.token_ids == expected, (drafter, jump_forward, prompt)
        assert valid_prefix(gpair, grammar, r.token_ids)


@pytest.mark.parametrize("kind", ["eagle3", "dflash", "dspark"])
@pytest.mark.parametrize("source", ["LIST", "FORCED"])
def test_greedy_constrained_with_a_speculators_head(gpair, source, kind):
    """Heads in the speculators format (two layers' features; EAGLE-3 over a draft vocabulary) drafting
    under the grammar: EAGLE-3 under its mask, the block heads fit to it by the loop."""
    from heads import new_block_head, new_eagle3

    torch.manual_seed(5)
    if kind == "eagle3":
        head = new_eagle3(gpair.target, [0, 1], draft_ids=torch.arange(0, 48))
    else:
        head = new_block_head(gpair.target, kind, [0, 1], block_size=4, mask_token_id=20)
    pair = ModelPair(target=gpair.target, draft=head.eval(), tokenizer=gpair.tokenizer, name=f"g-{kind}")
    grammar = G.ebnf(globals()[source])
    for prompt in PROMPTS:
        r = agentspec.generate(pair, prompt, "model", False, grammar, max_new_tokens=24, num_draft_tokens=3)
        assert r.token_ids == reference(pair, prompt, grammar, 24), prompt
        assert r.stats.draft_tokens > 0


def test_jump_forward_forces_tokens_and_saves_passes(gpair):
    grammar = G.ebnf(FORCED)
    prompt = PROMPTS[0]
    plain = agentspec.generate(gpair, prompt, "none", False, grammar, max_new_tokens=20, jump_forward=False)
    jumped = agentspec.generate(gpair, prompt, "none", False, grammar, max_new_tokens=20)
    assert jumped.token_ids == plain.token_ids
    assert plain.stats.verify_steps == 20 and plain.stats.forced_tokens == 0
    s = jumped.stats
    assert s.forced_tokens > 0 and s.jump_forward_tokens > 0
    assert s.jump_forward_accepted <= s.jump_forward_tokens
    assert s.verify_steps < plain.stats.verify_steps
    # every output token is accounted for: forced, or one per verify pass plus accepted drafts
    assert s.output_tokens == s.forced_tokens + s.verify_steps + s.accepted_tokens


def test_grammar_end_forces_eos_without_a_pass(eos_pair):
    grammar = G.ebnf('root ::= "[" [0-2] "]"')
    r = agentspec.generate(eos_pair, PROMPTS[0], "none", False, grammar, max_new_tokens=10)
    assert r.finish_reason == "stop"
    assert r.token_ids[-1] == EOS and r.text.startswith("[") and r.text.endswith("]")
    assert r.stats.forced_tokens >= 2  # "]" and EOS: nothing else may follow the digit
    plain = agentspec.generate(
        eos_pair, PROMPTS[0], "none", False, grammar, max_new_tokens=10, jump_forward=False
    )
    assert plain.token_ids == r.token_ids and plain.stats.verify_steps == len(r.token_ids)
    assert r.stats.verify_steps < plain.stats.verify_steps


@pytest.mark.parametrize("drafter", ["model", "prompt_lookup"])
def test_a_draft_reaching_the_grammar_end_changes_nothing(eos_pair, drafter):
    """A grammar-aware draft model drafts through the forced end, EOS included, onto the path:
    the loop must still verify it (a bug once read the path's terminated state as the call's)."""
    # a 3-token draft and its bonus fill "[ddd"; the next pass starts with the forced "x" and
    # drafts the rest: a digit, the forced "]" and EOS
    grammar = G.ebnf('root ::= "[" [0-2] [0-2] [0-2] "x" [0-2] "]"')
    for prompt in PROMPTS:
        expected = reference(eos_pair, prompt, grammar, 12)
        r = agentspec.generate(
            eos_pair, prompt, drafter, False, grammar, max_new_tokens=12, num_draft_tokens=3
        )
        assert r.token_ids == expected and expected[-1] == EOS, (prompt, r.token_ids, expected)
        assert r.finish_reason == "stop"


def test_stream_with_grammar_matches_generate(gpair):
    grammar = G.ebnf(FORCED)
    whole = agentspec.generate(gpair, PROMPTS[1], "model", False, grammar, max_new_tokens=16)
    steps = list(agentspec.stream(gpair, PROMPTS[1], "model", False, grammar, max_new_tokens=16))
    assert [t for s in steps for t in s.tokens] == whole.token_ids
    assert "".join(s.text for s in steps) == whole.text
    assert sum(s.forced for s in steps) == whole.stats.forced_tokens


def test_model_drafter_proposes_only_valid_tokens(gpair):
    grammar = G.ebnf(LIST)
    config = agentspec.GenerationConfig(temperature=1.0)
    gen = torch.Generator().manual_seed(0)
    for seed in range(5):
        c = G.Constraint.for_pair(gpair, grammar)
        drafter = ModelDrafter(gpair.draft, vocab_size=64)
        gen.manual_seed(seed)
        draft = drafter.propose(PROMPTS[0], 6, config, gen, constraint=c)
        assert c.path == draft.tokens and len(draft.tokens) == 6
        assert valid_prefix(gpair, grammar, draft.tokens)
        # q is the masked distribution each token was drawn from
        masks = c.masks(len(draft.tokens))
        assert bool((draft.q[~masks] == 0).all())
        assert torch.allclose(draft.q.sum(-1), torch.ones(len(draft.tokens)))


class Crashing(Drafter):
    """Pushes a token onto the constraint's path, then fails: the loop must undo and carry on."""

    name = "crashing"
    masks_own_draft = True

    def propose(self, seq, k, config, generator, constraint=None):
        if constraint is not None:
            allowed = constraint.allowed().nonzero()[0, 0]
            constraint.push(int(allowed))
        raise RuntimeError("draft crashed")

    def feedback(self, seq, n_accepted, n_drafted):
        pass

    def reset(self):
        pass


def test_a_crashing_drafter_under_a_grammar_changes_nothing(gpair):
    grammar = G.ebnf(LIST)
    expected = reference(gpair, PROMPTS[0], grammar, 12)
    r = agentspec.generate(gpair, PROMPTS[0], Crashing(), False, grammar, max_new_tokens=12)
    assert r.token_ids == expected and r.stats.draft_failures == 1


def test_constraint_path_commit_and_rollback(gpair):
    grammar = G.ebnf(LIST)
    c = G.Constraint.for_pair(gpair, grammar)
    start = c.allowed().nonzero().flatten().tolist()
    assert start == [0, 6]  # "[" or "[1"
    assert not c.push(1)  # "0" cannot start the list
    assert c.push(0) and c.push(5) and c.push(4)  # "[", "12", ","
    assert not c.push(4)  # ",," is not valid
    masks = c.masks(5)
    assert masks[0].nonzero().flatten().tolist() == start
    assert bool(masks[4].all())  # past the end of the path: unmasked
    c.commit(2)  # keep "[", "12"; roll back ","
    assert c.path == [] and bool(c.allowed()[4])  # "," is allowed again after "12"
    assert c.push(7)  # ",2"
    c.rewind(0)
    assert c.path == [] and c.push(4)


@pytest.mark.parametrize("vocab", [64, 50])  # 50: the last 32-bit word runs past the vocabulary
def test_packed_masks_apply_as_the_bool_masks_do(gpair, vocab):
    c = G.Constraint(gpair.grammar_compiler.compile(G.ebnf(LIST)), vocab)
    assert c.push(0) and c.push(5)  # "[", "12"
    bitmasks, masks = c.bitmasks(4), c.masks(4)
    assert bitmasks.shape == (4, -(-vocab // 32)) and bitmasks.dtype == torch.int32
    assert torch.equal(G.unpack_bitmask(bitmasks, vocab), masks)
    assert bool(masks[3].all())  # past the end of the path: unmasked
    logits = torch.randn(4, vocab)
    before = logits.clone()
    assert torch.equal(G.apply_bitmask(logits, bitmasks), G.apply_mask(logits, masks))
    assert torch.equal(logits, before)  # a new tensor: the input is left alone
    allowed = c.allowed()
    for t in range(vocab):  # push() reads the packed row: the same tokens as allowed()
        assert c.push(t) == bool(allowed[t]), f"{t=}"
        c.rewind(2)


def test_a_row_after_a_stop_token_is_left_unmasked(eos_pair):
    c = G.Constraint.for_pair(eos_pair, G.regex("ab"))
    assert c.push(12) and c.push(EOS) and c.terminated  # "ab", then the stop token
    assert not bool(c.allowed().any())
    assert int(c.bitmasks(3)[2].eq(-1).all()) == 1 and bool(c.masks(3)[2].all())


def test_each_pair_compiles_with_its_own_compiler(gpair, eos_pair):
    assert gpair.grammar_compiler is gpair.grammar_compiler
    assert gpair.grammar_compiler is not eos_pair.grammar_compiler  # another tokenizer and EOS
    assert eos_pair.grammar_compiler.eos == [EOS]


def test_bad_grammars_fail_when_built():
    with pytest.raises(G.GrammarError, match="EBNF"):
        G.ebnf("root ::= (")
    with pytest.raises(G.GrammarError, match="JSON schema"):
        G.json_schema({"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}})
    with pytest.raises(G.GrammarError, match="must be a dict"):
        G.json_schema("not a schema")
    good = {"type": "function", "function": {"name": "ok", "parameters": {"type": "object"}}}
    bad = {"type": "function", "function": {"name": "broken", "parameters": {"type": "object", "properties": {"x": {"$ref": "#/nowhere"}}}}}  # fmt: skip  # noqa: E501
    with pytest.raises(G.GrammarError, match="'broken'"):
        G.tool_calls([good, bad], "any")
    with pytest.raises(G.GrammarError, match="no name"):
        G.tool_calls([{"type": "function", "function": {"parameters": {}}}], "any")


def test_grammars_are_built_and_compiled_once(gpair):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert G.tool_calls([tool], "any") is G.tool_calls([dict(tool)], "any")
    g = G.ebnf(LIST)
    first = gpair.grammar_compiler.compile(g)
    assert gpair.grammar_compiler.compile(G.ebnf(LIST)) is first


# --- sampling: the distribution is the target's restricted to the grammar ------------------------

V = 16
N = 800


@pytest.fixture(scope="module")
def spair(one_thread, tiny_llama, perturbed, fake_tokenizer) -> ModelPair:
    target = tiny_llama(0, vocab_size=V, layers=1, max_positions=64, logit_scale=30.0)
    draft = perturbed(target, seed=1, noise=0.1)
    return ModelPair(target=target, draft=draft, tokenizer=fake_tokenizer(pieces=PIECES))


@torch.inference_mode()
def exact_constrained(pair: ModelPair, prompt: list[int], grammar: G.Grammar, temperature: float):
    """P(first 3 tokens = a, b, c) under the grammar-masked, warped target, as [V**3]."""
    c = G.Constraint.for_pair(pair, grammar)
    m0 = c.masks(1)[0]
    m1 = torch.ones(V, V, dtype=torch.bool)  # [a, V] mask after a (all True where a is invalid)
    m2 = torch.ones(V, V, V, dtype=torch.bool)  # [a, b, V] mask after a, b
    for a in range(V):
        if c.push(a):
            m1[a] = c.allowed()
            for b in range(V):
                if c.push(b):
                    m2[a, b] = c.allowed()
                    c.rewind(1)
            c.rewind(0)
    a = torch.arange(V).repeat_interleave(V)
    b = torch.arange(V).repeat(V)
    x = torch.cat([torch.tensor(prompt).expand(V * V, -1), a[:, None], b[:, None]], dim=1)
    logits = pair.target(input_ids=x).logits[:, -3:].float()  # [V*V, 3, V]
    logits[:, 0] = G.apply_mask(logits[:, 0], m0)
    logits[:, 1] = G.apply_mask(logits[:, 1], m1[a])
    logits[:, 2] = G.apply_mask(logits[:, 2], m2.view(V * V, V))
    p = probabilities(logits, temperature)
    p1, p2, p3 = p[0, 0], p[::V, 1], p[:, 2].view(V, V, V)
    return (p1[:, None, None] * p2[:, :, None] * p3).flatten().double()


class Skewed(Drafter):
    """Ignores the grammar (its ``propose`` takes no constraint) and draws each token from a fixed
    q: half its mass on "[", the rest spread over the vocabulary, mostly on tokens the grammar
    forbids. It reports that q, so an invalid token with a real q must go through rejection and
    the residual exactly. Measured power: cutting such a draft before the invalid token instead
    (sampling the target directly there) moves the first token's distribution by TV ~0.18, which
    this test catches."""

    name = "skewed"

    def propose(self, seq, k, config, generator) -> Draft:
        q = torch.full((k, V), 0.5 / (V - 1))
        q[:, 0] = 0.5
        return Draft(torch.multinomial(q, 1, generator=generator).flatten().tolist(), q)

    def feedback(self, seq, n_accepted, n_drafted):
        pass

    def reset(self):
        pass


@pytest.mark.parametrize(
    ("drafter", "temperature", "n"),
    [
        ("model", 0.8, N),
        ("skewed", 1.2, N),
        ("prompt_lookup", 1.0, N),
        pytest.param("model", 1.3, 20_000, marks=pytest.mark.slow),
        pytest.param("skewed", 0.7, 20_000, marks=pytest.mark.slow),
    ],
)
def test_constrained_sampling_is_lossless(spair, drafter, temperature, n):
    grammar = G.ebnf(LIST)
    prompt = [0, 1, 4, 2, 4, 5, 4, 1, 2, 4, 3]  # "[0,1,12,2,12", so prompt lookup finds n-grams
    probs = exact_constrained(spair, prompt, grammar, temperature)
    d = Skewed() if drafter == "skewed" else drafter
    counts = torch.zeros(V**3, dtype=torch.long)
    accepted = drafted = 0
    for seed in range(n):
        r = agentspec.generate(
            spair, prompt, d, False, grammar, max_new_tokens=3, num_draft_tokens=2, seed=seed,
            temperature=temperature, eos_token_ids=frozenset(),
        )  # fmt: skip
        a, b, c = r.token_ids
        counts[(a * V + b) * V + c] += 1
        accepted += r.stats.accepted_tokens
        drafted += r.stats.draft_tokens
    assert int(counts[probs == 0].sum()) == 0, "a grammar-invalid output was sampled"
    stat, df, p_value = chi_square(counts, probs)
    report = (
        f"{drafter} T={temperature}: chi2={stat:.1f} df={df} p={p_value:.3g} accepted {accepted}/{drafted}"
    )
    assert 0 < accepted < drafted, report
    assert p_value > 1e-3, report


@pytest.mark.parametrize("source", [LIST, FORCED])
def test_forced_reads_the_packed_mask_as_the_bool_mask_does(gpair, source):
    """``forced()`` (bits of the packed mask) names the one allowed token exactly when ``allowed()`` has
    one, along every branch of a short walk through the grammar (first and last tokens allowed)."""
    c = G.Constraint.for_pair(gpair, G.ebnf(source))
    for step in range(12):
        allowed = c.allowed().nonzero().flatten().tolist()
        assert c.forced() == (allowed[0] if len(allowed) == 1 else None), (step, allowed)
        if not allowed or c.terminated:
            break
        c.push(allowed[step % len(allowed)])
        c.commit(1)
