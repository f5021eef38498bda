"""Distillation: the draft learns the target's next-token distributions on the target's own text.

Loss per position (forward KL with the teacher's top-k as soft labels), named as in the code:

    p_i  = softmax(teacher top-k log-probs)_i        the teacher's top-k, renormalised   [N, k]
    log q = log_softmax(student logits)              over the full vocabulary            [N, V]
    KL   = sum_i p_i (log p_i - log q[id_i])         >= 0; 0 iff q = p on the k ids and 0 elsewhere

plus ``ce_weight`` x cross-entropy on the teacher's argmax (column 0). Positions are weighted
(responses 1, prompt positions ``prompt_weight``) and averaged. For greedy drafting only the argmax
matters; the full top-k also teaches the draft the target's confidence, which the confidence
schedule reads, and what sampled speculation needs (accept with min(1, p/q)).

The data order is a pure function of (seed, epoch), so a checkpoint holds only the step, the
trainable weights, the optimizer and RNG states: resuming replays the same batches.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from agentspec.distill.config import MODEL_FIELDS, DistillConfig
from agentspec.distill.data import Example, atomic_save
from agentspec.distill.student import own_state, trainable_parameters

MEASURE_STEPS = 6  # with steps=None: steps timed (after the first) to fix the total from the budget
KEEP_CHECKPOINTS = 2


# ------------------------------------------------------------------------------- pure functions
def distill_loss(
    logits: torch.Tensor,  # [N, V] student logits at the target positions
    topk_ids: torch.Tensor,  # [N, k] teacher ids, column 0 the argmax
    topk_logp: torch.Tensor,  # [N, k] teacher log-probs
    weights: torch.Tensor | None = None,  # [N] per-position weights (None: all 1)
    ce_weight: float = 0.0,
) -> torch.Tensor:
    """Weighted mean over positions of KL(teacher top-k || student) + ce_weight * CE(teacher argmax)."""
    log_q = F.log_softmax(logits.float(), dim=-1)  # [N, V]
    log_q_k = log_q.gather(-1, topk_ids.long())  # [N, k]
    log_p = F.log_softmax(topk_logp.float(), dim=-1)  # renormalised over the k ids
    per_pos = (log_p.exp() * (log_p - log_q_k)).sum(-1)  # [N]
    if ce_weight:
        per_pos = per_pos - ce_weight * log_q_k[:, 0]
    if weights is None:
        return per_pos.mean()
    return (per_pos * weights).sum() / weights.sum().clamp_min(1e-8)


def lr_at(step: int, total: int | None, cfg: DistillConfig) -> float:
    """Learning rate of step ``step`` (0-based): linear warm-up, then cosine to lr * min_lr_ratio."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if total is None or total <= cfg.warmup_steps:
        return cfg.lr  # total not known yet (the first steps of a budgeted run)
    progress = min(1.0, (step - cfg.warmup_steps) / (total - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_batches(lengths: Sequence[int], batch_tokens: int, seed: int) -> list[list[int]]:
    """One epoch: indices grouped into batches of about ``batch_tokens`` padded tokens.

    Shuffled, then sorted by length inside windows of 64 so that a batch pads little, then the
    batches shuffled again; a sequence longer than the budget is a batch of its own.
    """
    rng = random.Random(seed)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    batches: list[list[int]] = []
    for w in range(0, len(order), 64):
        window = sorted(order[w : w + 64], key=lambda i: lengths[i])
        batch: list[int] = []
        for i in window:
            if batch and max(lengths[j] for j in [*batch, i]) * (len(batch) + 1) > batch_tokens:
                batches.append(batch)
                batch = []
            batch.append(i)
        if batch:
            batches.append(batch)
    rng.shuffle(batches)
    return batches


class BatchPlan:
    """Step -> batch, over epochs of ``make_batches`` with the seed ``seed + epoch``."""

    def __init__(self, lengths: Sequence[int], batch_tokens: int, seed: int):
        self.lengths, self.batch_tokens, self.seed = list(lengths), batch_tokens, seed
        self.epochs: list[list[list[int]]] = []
        self.starts: list[int] = []  # first step of each epoch

    def batch(self, step: int) -> tuple[int, list[int]]:
        """(epoch, example indices) of ``step``."""
        while not self.epochs or step >= self.starts[-1] + len(self.epochs[-1]):
            start = self.starts[-1] + len(self.epochs[-1]) if self.epochs else 0
            self.epochs.append(make_batches(self.lengths, self.batch_tokens, self.seed + len(self.epochs)))
            self.starts.append(start)
        epoch = max(e for e, s in enumerate(self.starts) if s <= step)
        return epoch, self.epochs[epoch][step - self.starts[epoch]]


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] right-padded
    attention_mask: torch.Tensor  # [B, T]
    positions: torch.Tensor  # [N] flat indices into [B * T]: where a next token is predicted
    topk_ids: torch.Tensor  # [N, k]
    topk_logp: torch.Tensor  # [N, k]
    weights: torch.Tensor  # [N]
    n_tokens: int = 0  # real (unpadded) tokens in the batch


def collate(examples: Sequence[Example], pad_id: int, prompt_weight: float = 0.0) -> Batch:
    """Right-pad the sequences; gather the positions that predict a token with a teacher row.

    Input position ``first + j - 1`` predicts token ``first + j``: its teacher row is ``j``. Prompt
    rows (before ``start``) get ``prompt_weight`` and are dropped when it is 0.
    """
    width = max(len(e.ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    pos, tids, tlogp, weights = [], [], [], []
    for b, e in enumerate(examples):
        n = len(e.ids)
        ids[b, :n], mask[b, :n] = e.ids, 1
        rows = torch.arange(len(e.topk_ids))
        targets = e.first + rows  # the token each row predicts
        w = torch.where(targets >= e.start, 1.0, prompt_weight)
        keep = w > 0
        pos.append(b * width + targets[keep] - 1)
        tids.append(e.topk_ids[keep])
        tlogp.append(e.topk_logp[keep])
        weights.append(w[keep])
    return Batch(
        ids, mask, torch.cat(pos), torch.cat(tids), torch.cat(tlogp), torch.cat(weights), int(mask.sum())
    )


def student_logits(student, batch: Batch) -> torch.Tensor:
    """[N, V] logits at the batch's target positions; the LM head runs on those rows only."""
    device = student.get_input_embeddings().weight.device
    out = student.model(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device))
    hidden = out.last_hidden_state.flatten(0, 1)[batch.positions.to(device)]  # [N, H]
    return student.get_output_embeddings()(hidden)


def accepted_run(agree: torch.Tensor, k: int) -> torch.Tensor:
    """For each position, how many drafts in a row from there agree (at most ``k``). agree: [R] bool."""
    runs = torch.zeros(len(agree) + 1, dtype=torch.long)
    for i in range(len(agree) - 1, -1, -1):
        runs[i] = runs[i + 1] + 1 if agree[i] else 0
    return runs[:-1].clamp(max=k)


@torch.no_grad()
def evaluate(student, examples: Sequence[Example], pad_id: int, batch_tokens: int = 4096, k: int = 4) -> dict:
    """Held-out agreement of the draft's argmax with the target's, teacher-forced, on responses.

    On greedy responses the target's argmax is the next token, so a run of agreements is what a
    greedy draft would get accepted: ``mean_accepted_k4`` is the mean number of tokens a k-token
    draft starting at a response position would have accepted (``k`` = 4), in exact arithmetic.
    """
    if not examples:
        return {}
    was_training = student.training
    student.eval()
    agree_n, total_n, runs_sum = 0, 0, 0
    by_kind: dict[str, list[int]] = {}
    lengths = [len(e.ids) for e in examples]
    for batch_idx in make_batches(lengths, batch_tokens, seed=0):
        group = [examples[i] for i in batch_idx]
        batch = collate(group, pad_id, prompt_weight=0.0)
        pred = student_logits(student, batch).argmax(-1).cpu()
        offset = 0
        for e in group:
            n = int((e.first + torch.arange(len(e.topk_ids)) >= e.start).sum())
            agree = (
                pred[offset : offset + n] == e.topk_ids[-n:, 0].long()
                if n
                else torch.zeros(0, dtype=torch.bool)
            )
            offset += n
            agree_n += int(agree.sum())
            total_n += n
            runs_sum += int(accepted_run(agree, k).sum())
            counts = by_kind.setdefault(e.kind, [0, 0])
            counts[0] += int(agree.sum())
            counts[1] += n
    student.train(was_training)
    return {
        "top1_agreement": agree_n / max(total_n, 1),
        f"mean_accepted_k{k}": runs_sum / max(total_n, 1),
        "positions": total_n,
        "by_kind": {kind: a / max(n, 1) for kind, (a, n) in sorted(by_kind.items())},
    }


class LayersObjective:
    """The loss and held-out evaluation of a draft of decoder layers (``architecture="layers"``)."""

    def __init__(self, student, eval_examples: Sequence[Example], cfg: DistillConfig, pad_id: int):
        self.student, self.eval_examples, self.cfg, self.pad_id = student, eval_examples, cfg, pad_id

    def loss(self, examples: Sequence[Example]) -> tuple[torch.Tensor, int]:
        batch = collate(examples, self.pad_id, self.cfg.prompt_weight)
        logits = student_logits(self.student, batch)
        device = logits.device
        loss = distill_loss(
            logits,
            batch.topk_ids.to(device),
            batch.topk_logp.to(device),
            batch.weights.to(device),
            self.cfg.ce_weight,
        )
        return loss, batch.n_tokens

    def evaluate(self) -> dict:
        return evaluate(self.student, self.eval_examples, self.pad_id, self.cfg.batch_tokens)


# -------------------------------------------------------------------------------------- the loop
@dataclass
class TrainState:
    step: int = 0
    total_steps: int | None = None  # fixed once known (steps, or estimated from the budget)
    seconds: float = 0.0  # wall time of training (evaluation, checkpoints included), over all runs
    tokens: int = 0  # real tokens seen
    eval_seconds: float = 0.0  # one held-out evaluation's time (the end reserve)
    initial_eval: dict = field(default_factory=dict)  # held-out metrics before training
    losses: list[float] = field(default_factory=list)  # mean loss per checkpoint interval


def checkpoint_paths(folder: Path) -> list[Path]:
    return sorted(folder.glob("step-*.pt"))


def save_checkpoint(folder: Path, student, opt, state: TrainState, cfg: DistillConfig) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step-{state.step:07d}.pt"
    atomic_save(
        {
            "student": own_state(student),
            "optimizer": opt.state_dict(),
            "state": state.__dict__,
            "config": cfg.as_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        },
        path,
    )
    for old in checkpoint_paths(folder)[:-KEEP_CHECKPOINTS]:
        old.unlink()
    return path


def load_checkpoint(folder: Path, student, opt, cfg: DistillConfig) -> TrainState | None:
    paths = checkpoint_paths(folder)
    if not paths:
        return None
    ckpt = torch.load(paths[-1], map_location="cpu", weights_only=False)
    for name in MODEL_FIELDS:
        if ckpt["config"].get(name) != cfg.as_dict()[name]:
            raise ValueError(
                f"{name}: {cfg.as_dict()[name]!r} differs from {ckpt['config'].get(name)!r} of the "
                f"checkpoint {paths[-1]}; use the same value, another --out folder, or resume=False to "
                "start over"
            )
    student.load_state_dict(ckpt["student"], strict=False)
    opt.load_state_dict(ckpt["optimizer"])
    torch.set_rng_state(ckpt["rng"]["torch"])
    random.setstate(ckpt["rng"]["python"])
    return TrainState(**ckpt["state"])


def train(
    student,
    train_examples: Sequence[Example],
    eval_examples: Sequence[Example],
    cfg: DistillConfig,
    folder: Path,
    *,
    pad_id: int,
    deadline: float | None = None,
    log: Callable[[str], None] = print,
    objective=None,
) -> TrainState:
    """Train ``student`` on ``train_examples``; checkpoints in ``folder``; stop at ``deadline``.

    ``objective`` gives each batch's loss and the held-out evaluation (``loss(examples) -> (loss,
    tokens)``, ``evaluate() -> dict``); None: ``LayersObjective`` (an EAGLE head passes its own).

    With ``cfg.steps`` the total is fixed; else it is estimated from the first steps' time and the
    time left before ``deadline`` (minus one evaluation), then fixed and saved. A run that meets the
    deadline before the total saves a checkpoint and returns: the caller evaluates and saves.
    """
    from tqdm.auto import tqdm

    if objective is None:
        objective = LayersObjective(student, eval_examples, cfg, pad_id)
    params = trainable_parameters(student)
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    state = _start(student, opt, objective, cfg, folder, log)
    plan = BatchPlan([len(e.ids) for e in train_examples], cfg.batch_tokens, cfg.seed)
    student.train()
    bar = tqdm(
        total=state.total_steps, initial=state.step, disable=not cfg.progress, desc="distill", unit="step"
    )
    step_times: list[float] = []  # this run's step times, the first one left out
    interval_loss: list[float] = []
    t_run, seconds_before = time.monotonic(), state.seconds  # state.seconds: wall time, all runs
    first_step = state.step
    while state.total_steps is None or state.step < state.total_steps:
        mean_step = sum(step_times) / len(step_times) if step_times else 0.0
        if deadline is not None and time.monotonic() + mean_step + state.eval_seconds > deadline:
            log(f"time budget reached at step {state.step}")
            break
        t0 = time.perf_counter()
        lr = lr_at(state.step, state.total_steps, cfg)
        loss, n_tokens = _optimiser_step(
            objective, opt, params, plan.batch(state.step)[1], train_examples, lr, cfg
        )
        seconds = time.perf_counter() - t0
        state.step += 1
        state.seconds = seconds_before + time.monotonic() - t_run
        state.tokens += n_tokens
        interval_loss.append(loss.item())
        if state.step > first_step + 1:  # the first step of a run pays one-off costs
            step_times.append(seconds)
        if state.total_steps is None and len(step_times) >= MEASURE_STEPS and deadline is not None:
            state.total_steps = bar.total = _steps_that_fit(state, step_times, deadline)
            log(f"{state.total_steps} steps fit in the time budget")
        bar.update(1)
        bar.set_postfix(loss=f"{interval_loss[-1]:.3f}", lr=f"{lr:.1e}", tok_s=f"{n_tokens / seconds:.0f}")
        if state.step % cfg.checkpoint_every == 0:
            state.losses.append(sum(interval_loss) / len(interval_loss))
            interval_loss = []
            save_checkpoint(folder, student, opt, state, cfg)
    bar.close()
    if interval_loss:
        state.losses.append(sum(interval_loss) / len(interval_loss))
    # a run stopped before its total was estimated keeps total_steps None: a resumed run estimates it
    state.seconds = seconds_before + time.monotonic() - t_run
    save_checkpoint(folder, student, opt, state, cfg)
    student.eval()
    return state


def _start(
    student, opt, objective, cfg: DistillConfig, folder: Path, log: Callable[[str], None]
) -> TrainState:
    """The state to train from: the last checkpoint when resuming, else a fresh one evaluated once.

    A fixed ``cfg.steps`` is the total either way.
    """
    state = load_checkpoint(folder, student, opt, cfg) if cfg.resume else None
    if state is not None:
        log(f"resuming from step {state.step} ({folder})")
    else:
        state = TrainState(total_steps=cfg.steps)
        torch.manual_seed(cfg.seed)
        t0 = time.perf_counter()
        state.initial_eval = objective.evaluate()
        state.eval_seconds = state.seconds = time.perf_counter() - t0
    if cfg.steps is not None:
        state.total_steps = cfg.steps
    return state


def _optimiser_step(objective, opt, params, idx, examples: Sequence[Example], lr: float, cfg: DistillConfig):
    """One AdamW step at ``lr`` on the examples at ``idx``; returns the batch's loss and token count."""
    for group in opt.param_groups:
        group["lr"] = lr
    loss, n_tokens = objective.loss([examples[i] for i in idx])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss, n_tokens


def _steps_that_fit(state: TrainState, step_times: list[float], deadline: float) -> int:
    """The run's total steps: those done and those that fit before ``deadline`` (one evaluation kept)."""
    left = deadline - time.monotonic() - state.eval_seconds
    typical = sorted(step_times)[len(step_times) // 2]  # the median: robust to a stall
    return state.step + max(0, int(0.98 * left / typical))
