"""Training an EAGLE head (``agentspec.drafters.eagle``): the target's features, batches, loss, evaluation.

Indexing, as in the drafter: the head's entry at position p reads (f_{p-1}, x_p), with a zero
feature at p = 0, and its output h_p is trained towards the target's own f_p:

    loss_p = SmoothL1(h_p / s, f_p / s)                 feature regression (s: the features' std)
           + cls_weight * CE(softmax(W f_p), W h_p)      the target's next-token distribution

over the LM-head rows W the draft scores (its ``draft_vocab``), so the head learns the
distribution it drafts from, at the cost of the rows it keeps. Positions are weighted like the
layers draft's (responses 1, prompt positions ``prompt_weight``). Input features get uniform noise
of ``noise`` x s while training (EAGLE's remedy for drafting from its own, imperfect, outputs).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from agentspec.distill.data import Example, atomic_save, shard_path
from agentspec.distill.train import accepted_run, make_batches
from agentspec.forward import NORMED, PlainForward

FEATURE_NOISE = 0.1  # uniform noise on input features while training, in units of their std


def features_path(folder: Path, split: str, index: int) -> Path:
    return folder / f"features-{split}-{index:05d}.pt"


@torch.inference_mode()
def target_features(model, ids: torch.Tensor) -> torch.Tensor:
    """The target's final-norm output at every position of ``ids`` [L] -> [L, H] float16 on the CPU."""
    out = PlainForward(model)(ids[None].to(model.device), 1, features=(NORMED,))
    return out.features[0].to("cpu", torch.float16)


def attach_features(
    model,
    examples: list[Example],
    folder: Path,
    split: str,
    shard_prompts: int,
    on_shard: Callable | None = None,
) -> None:
    """Set ``features`` on each example: one target pass per example, saved per data shard.

    ``features-{split}-{i}.pt`` holds shard i's features (and the seconds spent, which count
    against the run's time budget like the data shards' do): a resumed run reads them back.
    """
    for index in range(0, (len(examples) + shard_prompts - 1) // shard_prompts):
        chunk = examples[index * shard_prompts : (index + 1) * shard_prompts]
        path = features_path(folder, split, index)
        if path.exists():
            feats = torch.load(path, map_location="cpu", weights_only=False)["features"]
        else:
            if not shard_path(folder, split, index).exists():
                raise FileNotFoundError(f"no data shard {index} of {split} in {folder}")
            t0 = time.perf_counter()
            feats = [target_features(model, e.ids) for e in chunk]
            atomic_save({"features": feats, "seconds": time.perf_counter() - t0}, path)
        for e, f in zip(chunk, feats):
            e.features = f
        if on_shard:
            on_shard(len(chunk))


def feature_scale(examples: Sequence[Example], n: int = 32) -> float:
    """The std of the target's features over the first ``n`` examples (the loss's unit)."""
    sample = torch.cat([e.features.float() for e in examples[:n]])
    return float(sample.std().clamp_min(1e-6))


def shift_right(x: torch.Tensor) -> torch.Tensor:
    """[B, T, H] -> the same, one position later: row p holds x[:, p - 1], zero at p = 0."""
    return torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)


@dataclass
class EagleBatch:
    ids: torch.Tensor  # [B, T] x_p, right-padded
    targets: torch.Tensor  # [B, T, H] f_p
    attention_mask: torch.Tensor  # [B, T]
    weights: torch.Tensor  # [B, T] loss weight (0 on padding)
    response: torch.Tensor  # [B, T] bool: p predicts a response token (p + 1 >= start, p + 1 < L)
    n_tokens: int

    @property
    def inputs(self) -> torch.Tensor:
        """[B, T, H] the features the entries read: f_{p-1}, 0 at p = 0."""
        return shift_right(self.targets)


def collate_eagle(examples: Sequence[Example], pad_id: int, prompt_weight: float) -> EagleBatch:
    width = max(len(e.ids) for e in examples)
    hidden = examples[0].features.shape[-1]
    b = len(examples)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    targets = torch.zeros((b, width, hidden))
    mask = torch.zeros((b, width), dtype=torch.long)
    weights = torch.zeros((b, width))
    response = torch.zeros((b, width), dtype=torch.bool)
    for r, e in enumerate(examples):
        n, f = len(e.ids), e.features.float()
        ids[r, :n], mask[r, :n] = e.ids, 1
        targets[r, :n] = f
        predicts = torch.arange(n) + 1  # the position of the token h_p predicts
        weights[r, :n] = torch.where(predicts >= e.start, 1.0, prompt_weight)
        response[r, :n] = (predicts >= e.start) & (predicts < n)
    return EagleBatch(ids, targets, mask, weights, response, int(mask.sum()))


def eagle_loss(
    hidden: torch.Tensor,  # [N, H] head outputs
    target: torch.Tensor,  # [N, H] the target's features
    head_rows: torch.Tensor,  # [S, H] the LM-head rows the draft scores
    weights: torch.Tensor,  # [N]
    scale: float,
    cls_weight: float,
) -> torch.Tensor:
    """Weighted mean of SmoothL1(h/s, f/s) + cls_weight * CE(softmax(W f), W h) (see module doc)."""
    hidden, target = hidden.float(), target.float()
    reg = F.smooth_l1_loss(hidden / scale, target / scale, reduction="none").mean(-1)
    with torch.no_grad():
        p = F.softmax(target @ head_rows.float().T, dim=-1)
    cls = -(p * F.log_softmax(hidden @ head_rows.float().T, dim=-1)).sum(-1)
    per_pos = reg + cls_weight * cls
    return (per_pos * weights).sum() / weights.sum().clamp_min(1e-8)


def chained_mask(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, T, 2T] additive mask for the chained entries, as drafting sees them.

    Keys: the T entries of the first pass (the target's features), then the T chained entries.
    Chained entry p (input: the head's own output at p - 1 and token x_p) attends to the first
    pass's entries before p and to itself, like a second draft token after the verified context.
    """
    b, t = attention_mask.shape
    i = torch.arange(t)[:, None]
    j = torch.arange(2 * t)[None, :]
    allowed = ((j < t) & (j < i)) | (j == t + i)  # [T, 2T]
    valid = torch.cat([attention_mask, attention_mask], dim=1).bool()  # padded keys never
    allowed = allowed[None] & valid[:, None, :]  # [B, T, 2T]
    mask = torch.zeros((b, 1, t, 2 * t), dtype=dtype)
    return mask.masked_fill(~allowed[:, None], torch.finfo(dtype).min)


def chained_hidden(head, first: torch.Tensor, ids: torch.Tensor, attention_mask: torch.Tensor, cache):
    """Outputs of the chained entries (see ``chained_mask``) over ``cache``, the first pass's keys.

    ``first`` [B, T, H]: the first pass's outputs; chained entry p reads first[:, p - 1] (zero at 0).
    """
    t = ids.shape[1]
    x = head.fc(torch.cat([shift_right(first), head.embed(ids).to(head.dtype)], dim=-1))
    mask = chained_mask(attention_mask.cpu(), head.dtype).to(head.device)
    positions = torch.arange(t, device=head.device)[None].expand(ids.shape[0], -1)
    out = head.decoder(
        inputs_embeds=x, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True
    )
    return out.last_hidden_state


class EagleObjective:
    """The loss and held-out evaluation of an EAGLE head (``architecture="eagle"``)."""

    def __init__(
        self,
        head,
        eval_examples: Sequence[Example],
        vocab: torch.Tensor | None,
        *,
        pad_id: int,
        prompt_weight: float,
        cls_weight: float,
        scale: float,
        batch_tokens: int,
        noise: float = FEATURE_NOISE,
        unroll: int = 1,
    ):
        self.head, self.eval_examples = head, eval_examples
        weight = head.get_output_embeddings().weight  # the target's full LM head while training
        self.full = weight.detach()
        self.rows = self.full if vocab is None else self.full[vocab.to(weight.device)]
        self.pad_id, self.prompt_weight, self.cls_weight = pad_id, prompt_weight, cls_weight
        self.scale, self.batch_tokens, self.noise = scale, batch_tokens, noise
        if unroll not in (1, 2):
            raise ValueError(f"eagle_unroll: 1 or 2, got {unroll!r}")
        self.unroll = unroll

    def _passes(self, batch: EagleBatch, noise: float, unroll: int) -> list[torch.Tensor]:
        """The head's outputs [B, T, H]: from the target's features, then (unroll 2) chained."""
        from transformers import DynamicCache

        device = self.head.device
        inputs = batch.inputs
        if noise:
            inputs = inputs + (torch.rand_like(inputs) - 0.5) * (2 * noise * self.scale)
        mask = batch.attention_mask.to(device)
        ids = batch.ids.to(device)
        cache = DynamicCache(config=self.head.decoder.config) if unroll > 1 else None
        h = self.head.hidden(inputs.to(device), ids, cache=cache, attention_mask=mask)
        if unroll == 1:
            return [h]
        return [h, chained_hidden(self.head, h, ids, batch.attention_mask, cache)]

    def loss(self, examples: Sequence[Example]) -> tuple[torch.Tensor, int]:
        """The loss of every pass (the chained one too, with ``unroll=2``: EAGLE-3's training-time
        test, so the head learns to draft from its own outputs), summed."""
        batch = collate_eagle(examples, self.pad_id, self.prompt_weight)
        device = self.head.device
        keep = batch.weights > 0
        loss = sum(
            eagle_loss(
                h[keep.to(device)],
                batch.targets[keep].to(device),
                self.rows,
                batch.weights[keep].to(device),
                self.scale,
                self.cls_weight,
            )
            for h in self._passes(batch, self.noise, self.unroll)
        )
        return loss, batch.n_tokens

    @torch.no_grad()
    def evaluate(self, k: int = 4) -> dict:
        """Held-out, teacher-forced agreement of the head's argmax (full LM head) with the target's.

        ``top1_agreement`` is the first draft token's acceptance (greedy). ``chained_agreement`` is
        the second's once the first was right: the chained entry reads the head's own output, as
        in drafting. ``mean_accepted_k4`` counts runs of first-pass agreement (real features at
        every step), an upper bound for drafts that chain the head's own outputs.
        """
        if not self.eval_examples:
            return {}
        was_training = self.head.training
        self.head.eval()
        weight = self.full.float()
        agree_n = total_n = runs_sum = chained_n = chained_total = 0
        by_kind: dict[str, list[int]] = {}
        for idx in make_batches([len(e.ids) for e in self.eval_examples], self.batch_tokens, seed=0):
            group = [self.eval_examples[i] for i in idx]
            batch = collate_eagle(group, self.pad_id, 0.0)
            device = self.head.device
            first, chained = self._passes(batch, noise=0.0, unroll=2)  # whatever the training used
            for r, e in enumerate(group):
                n = len(e.ids)
                want = (batch.targets[r, :n].to(device).float() @ weight.T).argmax(-1).cpu()
                agree1 = (first[r, :n].float() @ weight.T).argmax(-1).cpu() == want
                agree2 = (chained[r, :n].float() @ weight.T).argmax(-1).cpu() == want
                sel = batch.response[r, :n]
                agree = agree1[sel]
                agree_n += int(agree.sum())
                total_n += len(agree)
                runs_sum += int(accepted_run(agree, k).sum())
                after_right = sel.clone()
                after_right[0] = False
                after_right[1:] &= agree1[:-1] & sel[:-1]  # the first draft token was accepted
                chained_n += int(agree2[after_right].sum())
                chained_total += int(after_right.sum())
                counts = by_kind.setdefault(e.kind, [0, 0])
                counts[0] += int(agree.sum())
                counts[1] += len(agree)
        self.head.train(was_training)
        return {
            "top1_agreement": agree_n / max(total_n, 1),
            "chained_agreement": chained_n / max(chained_total, 1),
            f"mean_accepted_k{k}": runs_sum / max(total_n, 1),
            "positions": total_n,
            "by_kind": {kind: a / max(n, 1) for kind, (a, n) in sorted(by_kind.items())},
        }
