"""Speculative sampling is lossless: its output has exactly the target's distribution.

With a 16-token vocabulary the target's exact distribution over its first 3 tokens (16^3 = 4,096
continuations) comes from one batched forward pass, warped by ``agentspec.sampling.probabilities``
with the same temperature / top-k / top-p the sampler uses. Many seeded runs of
``agentspec.generate`` are then compared with it by a chi-square test.

The statistic: cells expected to get fewer than 5 samples are pooled into one (the chi-square
approximation needs about 5 per cell); the p-value comes from the chi-square survival function
(``gammaincc``). A configuration passes when p > 1e-3. The seeds are fixed (0..n-1), so each run of
the test draws the same samples: a correct sampler fails a given configuration with probability
1e-3 once, not on every run. A sampler that is wrong in a known way (a draft q that is not the
distribution its tokens came from: uniform, without temperature, without top-p) fails the same
statistic at the default sample size (measured p = 1e-35, 2e-6 and 7e-5):
``test_the_statistic_has_power`` checks that, so a pass here means something.
The models are made peaked (LM head x30: perplexity ~15 over 4,096 continuations at temperature
0.7, ~100 at 1.3) so that sampling mistakes move visible mass.
"""

from __future__ import annotations

import time

import pytest
import torch

import agentspec
from agentspec import Draft, ModelPair
from agentspec.drafters import Drafter
from agentspec.sampling import probabilities

V = 16  # vocabulary
NEW = 3  # tokens per run: V**NEW cells
ALPHA = 1e-3  # fail when the chi-square p-value is below this
N_DEFAULT = 800  # runs per configuration in the default suite
N_SLOW = 20_000  # runs per configuration with -m slow
MIN_EXPECTED = 5.0  # cells expected to get fewer samples are pooled

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def spair(one_thread, tiny_llama, perturbed, fake_tokenizer) -> ModelPair:
    target = tiny_llama(0, vocab_size=V, layers=1, max_positions=64, logit_scale=30.0)
    draft = perturbed(target, seed=1, noise=0.1)  # accepts ~75% of its tokens: both paths run
    return ModelPair(target=target, draft=draft, tokenizer=fake_tokenizer(V))


@pytest.fixture(scope="module")
def epair(spair) -> ModelPair:
    """The same target with an EAGLE head (untrained: its q still differs from p, both paths run)."""
    from agentspec.distill.student import build_eagle

    torch.manual_seed(2)
    return ModelPair(
        target=spair.target, draft=build_eagle(spair.target, 0).eval(), tokenizer=spair.tokenizer
    )


@pytest.fixture(scope="module")
def head_pairs(spair) -> dict[str, ModelPair]:
    """The same target with heads in the speculators format (untrained): an EAGLE-3 head over 10 of
    its 16 ids (q = 0 outside them), a DFlash head and a DSpark head (its Markov bias on the token it
    drew before: each slot's q depends on the draws before it)."""
    from heads import new_block_head, new_eagle3

    torch.manual_seed(3)
    vocab = torch.tensor([0, 1, 2, 3, 5, 7, 9, 11, 12, 15])
    heads = {
        "eagle3": new_eagle3(spair.target, [0, 1], draft_ids=vocab),
        "dflash": new_block_head(spair.target, "dflash", [0, 1], block_size=3, mask_token_id=4),
        "dspark": new_block_head(spair.target, "dspark", [1], block_size=3, mask_token_id=4, draft_ids=vocab),
    }
    with torch.no_grad():
        for p in heads["dspark"].markov_head.parameters():
            p.normal_(0, 0.5)
    return {
        name: ModelPair(target=spair.target, draft=h.eval(), tokenizer=spair.tokenizer)
        for name, h in heads.items()
    }


@pytest.fixture(scope="module")
def prompts(spair, hf_greedy) -> dict[str, list[int]]:
    base = [3, 9, 4, 1, 12, 7]
    # prompt lookup drafts only what the context holds: the target's own greedy continuation
    # settles into a cycle, so its n-grams recur and their continuations are likely tokens
    return {"model": base, "prompt_lookup": base + hf_greedy(spair.target, base, 10)}


@torch.inference_mode()
def exact_distribution(model, prompt: list[int], temperature, top_k=None, top_p=None) -> torch.Tensor:
    """P(first 3 tokens = a, b, c) under the warped target, flattened to [V**3] (index a*V*V+b*V+c)."""
    a = torch.arange(V).repeat_interleave(V)  # [V*V]: the first token of each row
    b = torch.arange(V).repeat(V)  # [V*V]: the second
    x = torch.cat([torch.tensor(prompt).expand(V * V, -1), a[:, None], b[:, None]], dim=1)
    p = probabilities(model(input_ids=x).logits[:, -3:], temperature, top_k, top_p)  # [V*V, 3, V]
    p1 = p[0, 0]  # [V] P(a | prompt): the same in every row
    p2 = p[::V, 1]  # [V, V] P(b | prompt, a): rows with b = 0 give one per a
    p3 = p[:, 2].view(V, V, V)  # [V, V, V] P(c | prompt, a, b)
    return (p1[:, None, None] * p2[:, :, None] * p3).flatten().double()


def sample_counts(pair, prompt, drafter, n, **options) -> tuple[torch.Tensor, int, int]:
    """Counts [V**3] of the first 3 tokens over seeds 0..n-1, and (accepted, drafted) totals."""
    counts = torch.zeros(V**NEW, dtype=torch.long)
    accepted = drafted = 0
    for seed in range(n):
        r = agentspec.generate(
            pair,
            prompt,
            drafter=drafter,
            max_new_tokens=NEW,
            num_draft_tokens=2,  # one pass can carry all 3 tokens; rejections take more passes
            seed=seed,
            eos_token_ids=frozenset(),  # no EOS: every run has exactly 3 tokens
            **options,
        )
        a, b, c = r.token_ids
        counts[(a * V + b) * V + c] += 1
        accepted += r.stats.accepted_tokens
        drafted += r.stats.draft_tokens
    return counts, accepted, drafted


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int, float]:
    """(statistic, degrees of freedom, p-value) of counts against probs, small cells pooled."""
    n = int(counts.sum())
    expected = probs * n
    observed = counts.double()
    big = expected >= MIN_EXPECTED
    obs = [observed[big]]
    exp = [expected[big]]
    if expected[~big].sum() > 0:  # the pooled cell (absent when all small cells have p = 0)
        obs.append(observed[~big].sum()[None])
        exp.append(expected[~big].sum()[None])
    o, e = torch.cat(obs), torch.cat(exp)
    stat = float(((o - e) ** 2 / e).sum())
    df = len(o) - 1
    p_value = float(
        torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2))
    )
    return stat, df, p_value


def check_lossless(pair, prompt, drafter, n, temperature, top_p=None, top_k=None, reproducible=False) -> str:
    start = time.perf_counter()
    probs = exact_distribution(pair.target, prompt, temperature, top_k, top_p)
    counts, accepted, drafted = sample_counts(
        pair, prompt, drafter, n, temperature=temperature, top_p=top_p, top_k=top_k, reproducible=reproducible
    )
    stat, df, p_value = chi_square(counts, probs)
    tv = 0.5 * float((counts.double() / n - probs).abs().sum())
    report = (
        f"{drafter} T={temperature} top_p={top_p} top_k={top_k} n={n}: chi2={stat:.1f} df={df} "
        f"p={p_value:.3g} TV={tv:.3f} acceptance={accepted}/{drafted} "
        f"({time.perf_counter() - start:.1f} s)"
    )
    assert int(counts[probs == 0].sum()) == 0, f"tokens outside top-k/top-p were sampled: {report}"
    assert 0 < accepted < drafted, f"both accept and reject paths must run: {report}"
    assert p_value > ALPHA, report
    return report


CONFIGS = [  # (drafter, temperature, top_p)
    ("model", 0.7, None),
    ("model", 1.3, None),
    ("model", 1.0, 0.8),
    ("prompt_lookup", 0.7, None),
    ("prompt_lookup", 1.3, None),
    ("prompt_lookup", 1.0, 0.8),
]


@pytest.mark.parametrize(
    ("drafter", "temperature", "top_p", "n"),
    [
        ("model", 0.7, 0.8, N_DEFAULT),  # the draft model passes q
        ("prompt_lookup", 1.3, None, N_DEFAULT),  # prompt lookup is one-hot (q = None)
        *[pytest.param(*c, N_SLOW, marks=pytest.mark.slow) for c in CONFIGS],
    ],
)
def test_speculative_sampling_is_lossless(spair, prompts, drafter, temperature, top_p, n):
    print(check_lossless(spair, prompts[drafter], drafter, n, temperature, top_p))


@pytest.mark.parametrize(
    ("drafter", "temperature", "top_p", "n"),
    [
        ("model", 0.9, 0.8, N_DEFAULT),
        pytest.param("prompt_lookup", 1.3, None, N_SLOW, marks=pytest.mark.slow),
    ],
)
def test_reproducible_sampling_is_lossless(spair, prompts, drafter, temperature, top_p, n):
    """Draws keyed by (seed, position) (``GenerationConfig.reproducible``, the Gumbel-max trick) and
    drafts verified as greedy ones: still exactly the target's distribution."""
    print(check_lossless(spair, prompts[drafter], drafter, n, temperature, top_p, reproducible=True))


@pytest.mark.parametrize(
    ("temperature", "top_p", "n"),
    [(0.9, None, N_DEFAULT), pytest.param(1.3, None, N_SLOW, marks=pytest.mark.slow)],
)
@pytest.mark.parametrize("head", ["eagle", "eagle3", "dflash", "dspark"])
def test_speculative_sampling_with_a_head_is_lossless(
    epair, head_pairs, prompts, head, temperature, top_p, n
):
    """The head drafts from the second pass on with the target's features (EAGLE: chaining its own
    outputs; EAGLE-3 from two layers, over a draft vocabulary; DFlash and DSpark a block at once)."""
    pair = epair if head == "eagle" else head_pairs[head]
    print(check_lossless(pair, prompts["model"], "model", n, temperature, top_p))


@pytest.mark.slow
def test_plain_sampling_is_lossless_with_top_k(spair, prompts):
    """The sampler without speculation, through top-k: the reference itself is right."""
    probs = exact_distribution(spair.target, prompts["model"], 0.9, top_k=4)
    counts, _, _ = sample_counts(spair, prompts["model"], "none", N_SLOW, temperature=0.9, top_k=4)
    assert int(counts[probs == 0].sum()) == 0
    stat, df, p_value = chi_square(counts, probs)
    assert p_value > ALPHA, f"{stat=} {df=} {p_value=}"


# --- the statistic can fail ----------------------------------------------------------------------


class MisreportingDrafter(Drafter):
    """A draft-model drafter that samples its tokens correctly but may report the wrong q.

    report="true" is the correct drafter (a control: it must pass); the others are the mistakes
    behind real losslessness bugs (transformers #32867, #47932): q uniform, q without the
    temperature, q without top-p. (Returning no q at all is NOT a mistake: the one-hot rule is
    lossless for any proposal, only slower, so it cannot serve as a power check.)
    """

    def __init__(self, model, report: str):
        self.model, self.report, self.name = model, report, f"q-{report}"

    @torch.inference_mode()
    def propose(self, seq, k, config, generator) -> Draft:
        ids, tokens, reported = list(seq), [], []
        for _ in range(k):
            logits = self.model(input_ids=torch.tensor([ids])).logits[0, -1]  # [V], no cache: simple
            q = probabilities(logits, config.temperature, config.top_k, config.top_p)  # x ~ q
            x = int(torch.multinomial(q, 1, generator=generator))
            if self.report == "uniform":
                q = torch.full_like(q, 1.0 / V)
            elif self.report == "unwarped":
                q = probabilities(logits, 1.0, config.top_k, config.top_p)
            elif self.report == "untruncated":
                q = probabilities(logits, config.temperature)
            tokens.append(x)
            reported.append(q)
            ids.append(x)
        return Draft(tokens, torch.stack(reported))

    def feedback(self, seq, n_accepted, n_drafted) -> None:
        pass

    def reset(self) -> None:
        pass


@pytest.mark.parametrize(
    ("report", "temperature", "top_p"),
    [("uniform", 1.3, None), ("unwarped", 0.7, None), ("untruncated", 1.0, 0.8)],
)
def test_the_statistic_has_power(spair, prompts, report, temperature, top_p):
    """The same statistic at the same sample size rejects a sampler whose q is wrong."""
    prompt = prompts["model"]
    probs = exact_distribution(spair.target, prompt, temperature, top_p=top_p)
    drafter = MisreportingDrafter(spair.draft, report)
    counts, _, _ = sample_counts(spair, prompt, drafter, N_DEFAULT, temperature=temperature, top_p=top_p)
    stat, df, p_value = chi_square(counts, probs)
    assert p_value < ALPHA, f"q {report}: {stat=:.1f} {df=} {p_value=:.3g}: the test would miss this bug"


def test_a_correct_custom_drafter_passes(spair, prompts):
    """The control for the power test: the same drafter reporting its true q is lossless."""
    drafter = MisreportingDrafter(spair.draft, "true")
    print(check_lossless(spair, prompts["model"], drafter, N_DEFAULT, 1.0, top_p=0.8))


def test_the_models_are_peaked(spair, prompts):
    """Near-uniform models would make any sampler look right."""
    for temperature, most in ((0.7, 40), (1.3, 200)):
        p = exact_distribution(spair.target, prompts["model"], temperature)
        perplexity = float(torch.exp(-(p * p.clamp_min(1e-300).log()).sum()))
        assert perplexity < most, f"{temperature=} {perplexity=} of {V**NEW} continuations"
