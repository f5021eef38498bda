"""Per-call statistics as data. Logging, LangChain metadata, spans and benchmarks all read this.

Conventions (as in vLLM's spec-decode metrics): ``mean_acceptance_length`` counts the token the
target adds on every verify pass, so it is ``(accepted + verify_steps) / verify_steps`` and is 1.0
for plain decoding; ``acceptance_histogram[i]`` counts verify passes that accepted exactly ``i``
draft tokens; ``accepted_per_position[i]`` counts passes whose draft token at position ``i`` was
accepted (vLLM's ``num_accepted_tokens_per_pos``: a token is accepted only after every one before it),
``drafted_per_position[i]`` those that drafted a token there, so their ratio is position ``i``'s
acceptance given the ones before it.

Per draft source (``drafter="auto"`` picks one per pass: "suffix", "model" or "none"; any other
drafter is its own single source), ``source_steps``, ``source_draft_tokens`` and
``source_accepted_tokens`` split ``verify_steps``, ``draft_tokens`` and ``accepted_tokens``; a pass
that verified no draft counts under "none", one that verified only grammar-forced tokens under
"jump_forward". The source of a proposal is its ``Draft.source``
(default: the drafter's name), which the decoding loop passes to ``observe_step``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace


@dataclass
class DecodeStats:
    drafter: str | None = None  # name of the drafter used (None: plain decoding)
    prompt_tokens: int = 0  # tokens in the request
    cached_tokens: int = 0  # prompt tokens whose KV state was restored or shared, not recomputed
    prefill_tokens: int = 0  # prompt tokens the target computed in this call
    # of cached_tokens, those copied from another call running beside it, which computed them
    shared_prefix_tokens: int = 0
    # prompt tokens this call newly wrote into the prefix cache (part of prompt_tokens; the output
    # it wrote is not counted). Set when the call's state is saved: after its last Step was yielded
    cache_creation_tokens: int = 0
    output_tokens: int = 0  # tokens returned (after EOS / stop / length trimming)
    draft_tokens: int = 0  # tokens proposed (by the drafter or a grammar's jump-forward) and verified
    accepted_tokens: int = 0  # of those, accepted by the target
    verify_steps: int = 0  # target forward passes after prefill (each yields >= 1 token)
    forced_tokens: int = 0  # output tokens a grammar forced: appended without any model guess
    jump_forward_tokens: int = 0  # of draft_tokens, those spelling text a grammar forced
    jump_forward_accepted: int = 0  # of those, accepted
    draft_failures: int = 0  # drafter exceptions survived by falling back to the target alone
    draft_cooldown: str | None = None  # a drafter this call decoded without: it kept failing (health)
    acceptance_histogram: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    # from the call's start (its wait for the pair and its cache restore included) to the end of the
    # first pass that gave tokens: counted here alone (a call's CallRecord.ttft_s reads it)
    time_to_first_token_s: float = 0.0
    total_time_s: float = 0.0
    finish_reason: str | None = None
    source_steps: dict[str, int] = field(default_factory=dict)  # verify passes per draft source
    source_draft_tokens: dict[str, int] = field(default_factory=dict)  # draft tokens verified, per source
    source_accepted_tokens: dict[str, int] = field(default_factory=dict)  # of those, accepted, per source

    def snapshot(self) -> DecodeStats:
        """A copy that later passes leave as it is: what a Step carries (its caller may read it up to a
        few passes behind the loop, which goes on updating the call's own)."""
        return replace(
            self,
            acceptance_histogram=list(self.acceptance_histogram),
            accepted_per_position=list(self.accepted_per_position),
            drafted_per_position=list(self.drafted_per_position),
            source_steps=dict(self.source_steps),
            source_draft_tokens=dict(self.source_draft_tokens),
            source_accepted_tokens=dict(self.source_accepted_tokens),
        )

    def observe_step(self, drafted: int, accepted: int, source: str | None = None) -> None:
        source = (source or self.drafter or "none") if drafted else "none"
        for counts, n in (
            (self.source_steps, 1),
            (self.source_draft_tokens, drafted),
            (self.source_accepted_tokens, accepted),
        ):
            counts[source] = counts.get(source, 0) + n
        self.verify_steps += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        _count(self.acceptance_histogram, range(accepted, accepted + 1))
        _count(self.accepted_per_position, range(accepted))
        _count(self.drafted_per_position, range(drafted))

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        steps = self.verify_steps
        return (self.accepted_tokens + steps) / steps if steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.total_time_s if self.total_time_s > 0 else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["acceptance_rate"] = self.acceptance_rate
        d["mean_acceptance_length"] = self.mean_acceptance_length
        d["tokens_per_second"] = self.tokens_per_second
        return d


def _count(counts: list[int], indices: range) -> None:
    """One more at each index of ``counts``, grown with zeros to reach them."""
    if len(counts) < indices.stop:
        counts.extend([0] * (indices.stop - len(counts)))
    for i in indices:
        counts[i] += 1
