"""``distill``: prompts -> the target's responses and distributions -> a trained draft folder.

Layout of ``out`` (the draft folder itself, loadable with ``load_pair(draft_model=out)``):
    agentspec_draft.json, config.json, model.safetensors, tokenizer files, README.md   the draft
    metrics.json          held-out agreement before and after training, data and time spent
    data/                 meta.json and shards (train-*.pt, eval-*.pt): resumable, deletable
    checkpoints/          step-*.pt, the last two: resumable, deletable

Time budget: one number for the whole run, counted across resumed runs (shards and checkpoints
record the seconds spent). The data stage stops before a shard that would pass
``data_budget_fraction`` of it; training stops before a step that would leave too little time for
the final evaluation. A resumed run never adds data once training has started (the batch order
depends on the data).
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from agentspec.distill.config import DistillConfig, default_init_layers
from agentspec.distill.data import (
    PromptItem,
    atomic_write_text,
    build_split,
    check_meta,
    data_meta,
    load_examples,
)
from agentspec.distill.eagle import EagleObjective, attach_features, feature_scale
from agentspec.distill.prompts import PromptSpec, is_heldout, make_prompts, render
from agentspec.distill.student import build_eagle, build_student, draft_vocab, save_draft
from agentspec.distill.train import LayersObjective, checkpoint_paths, train

logger = logging.getLogger(__name__)


def _log(cfg: DistillConfig):
    if not cfg.progress:
        return logger.info
    from tqdm.auto import tqdm

    return lambda msg: tqdm.write(f"[distill] {msg}", file=sys.stderr)


def load_target(target: Any, tokenizer: Any, device: torch.device):
    """(model in float32 on ``device``, tokenizer, name) for a hub id, folder, GGUF, model or None."""
    from transformers import PreTrainedModel

    from agentspec.models import DEFAULT_NAME, _load_one, ensure_default_model

    if isinstance(target, PreTrainedModel):
        model, tok, name = target, tokenizer, str(getattr(target, "name_or_path", "") or "model")
    else:
        name = DEFAULT_NAME if target is None else str(target)
        model, tok = _load_one(ensure_default_model() if target is None else target, device, torch.float32)
        tok = tokenizer if tokenizer is not None else tok
    model.requires_grad_(False)  # the teacher never trains; its embeddings and head are the draft's
    return model.eval(), tok, name


def special_ids(model, tokenizer) -> tuple[set[int], int]:
    """(every EOS id, the pad id): the tokenizer's and the generation config's EOS, as ModelPair."""
    eos: set[int] = set()
    for value in (
        getattr(tokenizer, "eos_token_id", None),
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
    ):
        if isinstance(value, int):
            eos.add(value)
        elif value is not None:
            eos.update(int(v) for v in value)
    pad = getattr(tokenizer, "pad_token_id", None)
    return eos, int(pad if pad is not None else min(eos, default=0))


def prompt_items(
    cfg: DistillConfig, tokenizer: Any, prompts: Sequence[PromptSpec | Sequence[int]] | None
) -> tuple[list[PromptItem], list[PromptItem]]:
    """(train, held-out) prompt items: the generator's prompts rendered, or the given ones."""
    import hashlib

    specs = make_prompts(cfg.n_prompts, cfg.seed) if prompts is None else list(prompts)
    train_items, eval_items = [], []
    for spec in specs:
        if isinstance(spec, PromptSpec):
            ids, kind, key = render(tokenizer, spec), spec.kind, spec.key()
        else:
            ids, kind = [int(t) for t in spec], "custom"
            key = hashlib.sha256(json.dumps(ids).encode()).hexdigest()
        if not ids:
            raise ValueError("prompts: an empty prompt")
        if is_heldout(key, cfg.heldout_fraction):
            if len(eval_items) < cfg.max_eval_prompts:  # greedy: agreement runs = accepted drafts
                eval_items.append(PromptItem(ids, kind, greedy=True))
        else:
            greedy = random.Random(f"mode:{cfg.seed}:{key}").random() < cfg.greedy_fraction
            train_items.append(PromptItem(ids, kind, greedy))
    return train_items, eval_items


def _shard_seconds(folder: Path) -> float:
    return sum(
        float(torch.load(p, map_location="cpu", weights_only=False)["seconds"]) for p in folder.glob("*-*.pt")
    )


def _train_seconds(folder: Path) -> float:
    paths = checkpoint_paths(folder)
    return (
        float(torch.load(paths[-1], map_location="cpu", weights_only=False)["state"]["seconds"])
        if paths
        else 0.0
    )


def distill(
    target: Any = None,
    out: str | Path = "agentspec-draft",
    *,
    tokenizer: Any = None,
    prompts: Sequence[PromptSpec | Sequence[int]] | None = None,
    config: DistillConfig | None = None,
    **options: Any,
) -> Path:
    """Distill a draft for ``target`` into the folder ``out``; return it.

    ``target``: a hub id, folder, ``.gguf`` file, a loaded model (then pass ``tokenizer``; it is used
    on its own device and dtype), or None for the embedded default (loaded in float32 on
    ``device``). ``prompts``: None for the built-in generator, or a list of
    ``PromptSpec`` / token-id lists (the only way for a tokenizer without a chat template).
    ``options`` are ``DistillConfig`` fields (on top of ``config`` when given).
    """
    cfg = (config or DistillConfig()).replace(**options) if options else (config or DistillConfig())
    log = _log(cfg)
    t_start = time.monotonic()
    out = Path(out).expanduser()
    data_dir, ckpt_dir = _folders(out, cfg.resume)
    from agentspec.models import default_device

    device = torch.device(cfg.device) if cfg.device else default_device()
    model, tok, name = load_target(target, tokenizer, device)
    eos_ids, pad_id = special_ids(model, tok)
    special = (eos_ids, pad_id)
    train_examples, eval_examples, deadline = _examples(
        model, tok, special, cfg, prompts, name, out, t_start, log
    )
    vocab = None
    n_vocab = model.get_output_embeddings().weight.shape[0]
    if cfg.draft_vocab is not None and cfg.draft_vocab < n_vocab:
        vocab = draft_vocab([e.ids for e in train_examples], n_vocab, cfg.draft_vocab)
    torch.manual_seed(cfg.seed)
    examples = (train_examples, eval_examples)
    student, objective, init_layers = _student(model, cfg, examples, data_dir, vocab, pad_id)
    fit = dict(pad_id=pad_id, deadline=deadline, log=log, objective=objective)
    state = train(student, train_examples, eval_examples, cfg, ckpt_dir, **fit)
    final = objective.evaluate()
    metrics = _metrics(name, cfg, prompts, state, final, train_examples, eval_examples, data_dir, init_layers)
    card = model_card(name, cfg, init_layers, metrics)
    info = {"init_layers": list(init_layers)}
    save_draft(student, out, card=card, target_name=name, tokenizer=tok, info=info, vocab=vocab)
    atomic_write_text(out / "metrics.json", json.dumps(metrics, indent=1) + "\n")
    if final:
        log(
            f"held-out top-1 agreement {final['top1_agreement']:.3f} "
            f"(before training: {state.initial_eval['top1_agreement']:.3f})"
        )
    log(f"draft saved to {out}")
    return out


def _examples(model, tok, special: tuple, cfg: DistillConfig, prompts, name: str, out: Path, t_start, log):
    """The training and held-out examples (built, or read back when resuming) and the run's deadline.

    ``special`` is ``(eos_ids, pad_id)``; the data and checkpoints are ``out``'s subfolders.
    """
    (eos_ids, pad_id), data_dir, ckpt_dir = special, out / "data", out / "checkpoints"
    train_items, eval_items = prompt_items(cfg, tok, prompts)
    if not train_items:
        raise ValueError("prompts: every prompt fell in the held-out split; give more prompts")
    check_meta(data_dir, data_meta(cfg, name, len(train_items), len(eval_items)))

    # time already spent in this folder by earlier runs counts against the budget
    spent_data, spent_train = _shard_seconds(data_dir), _train_seconds(ckpt_dir)
    budget = cfg.time_budget_s
    deadline = None if budget is None else t_start + budget - spent_data - spent_train
    if not checkpoint_paths(ckpt_dir):  # once training has started, the data stays as it is
        data_deadline = None if budget is None else t_start + budget * cfg.data_budget_fraction - spent_data
        _build_data(model, cfg, train_items, eval_items, data_dir, eos_ids, pad_id, data_deadline, log)
    train_examples, eval_examples = load_examples(data_dir, "train"), load_examples(data_dir, "eval")
    if not train_examples:
        raise RuntimeError(f"no training data in {data_dir}")  # not reached: one shard is always made
    return train_examples, eval_examples, deadline


def _metrics(
    name: str, cfg: DistillConfig, prompts, state, final, train_examples, eval_examples, data_dir, init_layers
):
    """What the run measured and how it was made: the draft folder's metrics.json."""
    metrics = {
        "target": name,
        "heldout_before": state.initial_eval,
        "heldout": final,
        "steps": state.step,
        "total_steps": state.total_steps,
        "train_tokens": state.tokens,
        "losses": state.losses,
        "data": data_summary(train_examples, eval_examples),
        "seconds": {"data": _shard_seconds(data_dir), "train": state.seconds},
        "init_layers": list(init_layers),
        "config": cfg.as_dict(),
    }
    metrics["prompts"] = (
        "given by the caller" if prompts is not None else f"agentspec.distill.prompts, seed {cfg.seed}"
    )
    return metrics


def _folders(out: Path, resume: bool) -> tuple[Path, Path]:
    """The data and checkpoint subfolders of ``out``, emptied first unless resuming."""
    data_dir, ckpt_dir = out / "data", out / "checkpoints"
    if not resume:
        for sub in (data_dir, ckpt_dir):  # only our own subfolders; the draft files are rewritten
            shutil.rmtree(sub, ignore_errors=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    return data_dir, ckpt_dir


def _build_data(
    model, cfg: DistillConfig, train_items, eval_items, data_dir: Path, eos_ids, pad_id, deadline, log
):
    """The target's responses to the held-out and training prompts, as shards in ``data_dir``."""
    from tqdm.auto import tqdm

    bar = tqdm(total=len(train_items) + len(eval_items), disable=not cfg.progress, desc="data", unit="prompt")
    common = dict(eos_ids=eos_ids, pad_id=pad_id, on_shard=bar.update)
    build_split(model, eval_items, data_dir, "eval", cfg, **common)
    done = build_split(model, train_items, data_dir, "train", cfg, deadline=deadline, **common)
    bar.close()
    if done.prompts < len(train_items):
        log(f"data budget reached after {done.prompts} of {len(train_items)} training prompts")


def _student(model, cfg: DistillConfig, examples: tuple, data_dir: Path, vocab, pad_id):
    """The draft to train, initialised from the target, its objective and the layers it started from.

    ``examples`` is ``(train_examples, eval_examples)``.
    """
    train_examples, eval_examples = examples
    n_target = model.config.num_hidden_layers
    if cfg.architecture != "eagle":
        init_layers = cfg.init_layers or default_init_layers(cfg.n_layers, n_target)
        student = build_student(model, cfg.n_layers, init_layers)
        return student, LayersObjective(student, eval_examples, cfg, pad_id), init_layers
    from tqdm.auto import tqdm

    # the target's features at every position: one more pass per example, saved
    n_examples = len(eval_examples) + len(train_examples)
    bar = tqdm(total=n_examples, disable=not cfg.progress, desc="features", unit="prompt")
    attach_features(model, eval_examples, data_dir, "eval", cfg.shard_prompts, on_shard=bar.update)
    attach_features(model, train_examples, data_dir, "train", cfg.shard_prompts, on_shard=bar.update)
    bar.close()
    init_layers = cfg.init_layers or (n_target - 1,)
    student = build_eagle(model, init_layers[0])
    objective = EagleObjective(
        student,
        eval_examples,
        vocab,
        pad_id=pad_id,
        prompt_weight=cfg.prompt_weight,
        cls_weight=cfg.eagle_cls_weight,
        scale=feature_scale(train_examples),
        batch_tokens=cfg.batch_tokens,
        unroll=cfg.eagle_unroll,
    )
    return student, objective, init_layers


def data_summary(train_examples, eval_examples) -> dict:
    def part(examples) -> dict:
        kinds: dict[str, int] = {}
        for e in examples:
            kinds[e.kind] = kinds.get(e.kind, 0) + 1
        return {
            "prompts": len(examples),
            "greedy": sum(e.greedy for e in examples),
            "prompt_tokens": sum(e.start for e in examples),
            "response_tokens": sum(len(e.ids) - e.start for e in examples),
            "by_kind": dict(sorted(kinds.items())),
        }

    return {"train": part(train_examples), "heldout": part(eval_examples)}


def model_card(name: str, cfg: DistillConfig, init_layers, metrics: dict) -> str:
    """The draft folder's README.md: recipe, data, held-out measurements."""
    from agentspec.models import DEFAULT_NAME

    d, h, h0 = metrics["data"], metrics["heldout"], metrics["heldout_before"]
    target_arg = "" if name == DEFAULT_NAME else f"{name!r}, "  # the embedded default: no model argument
    kinds = ", ".join(f"{k} {n}" for k, n in d["train"]["by_kind"].items())
    lines = [
        f"# Distilled draft for {name}",
        "",
        f"{'An EAGLE' if cfg.architecture == 'eagle' else f'A {cfg.n_layers}-layer'} draft for "
        "speculative decoding with agentspec, distilled from "
        f"`{name}` on the target's own responses. It shares the target's input embeddings and LM head "
        "(not stored here): load it with the target,",
        "",
        "```python",
        f'pair = agentspec.load_pair({target_arg}draft_model="<this folder>")',
        "```",
        "",
        "## Recipe",
        "",
        *_recipe(cfg, init_layers, metrics),
        "",
        "## Data",
        "",
        f"Prompts ({metrics['prompts']}): {d['train']['prompts']} for "
        f"training ({kinds}), answered by the target ({d['train']['greedy']} greedily, the rest sampled at "
        f"temperature {cfg.sample_temperature}; at most {cfg.max_new_tokens} new tokens): "
        f"{d['train']['response_tokens']:,} response tokens. "
        f"{d['heldout']['prompts']} held-out prompts (by a hash of their content) answered "
        "greedily for the measurements below; no training step saw them.",
        "",
        "## Measured",
        "",
    ]
    lines += _measured(h, h0)
    lines += ["Acceptance in speculative decoding: not measured yet.", ""]
    return "\n".join(lines)


def _recipe(cfg: DistillConfig, init_layers, metrics: dict) -> list[str]:
    """The model card's recipe: the draft's architecture, its loss, the optimiser and the run."""
    return [
        (
            f"- draft: an EAGLE head (one decoder layer on the target's final hidden states and the "
            f"next token's embedding, Li et al. 2024), its layer initialised from target layer "
            f"{init_layers[0]}, its norm from the target's final norm; embeddings and LM head shared "
            "and frozen"
            if cfg.architecture == "eagle"
            else f"- draft: {cfg.n_layers} decoder layers initialised from target layers "
            f"{list(init_layers)}, final norm from the target's; embeddings and LM head shared and frozen"
        )
        + (
            f"; when drafting, the head scores the {cfg.draft_vocab:,} ids most frequent in the data "
            "(FR-Spec)"
            if cfg.draft_vocab
            else ""
        ),
        (
            "- loss: SmoothL1 to the target's next hidden state (in units of its std) + "
            f"{cfg.eagle_cls_weight} x cross-entropy to the target's distribution over the head's ids"
            if cfg.architecture == "eagle"
            else f"- loss: forward KL to the target's top-{cfg.top_k} distribution (renormalised)"
            + (f" + {cfg.ce_weight} x CE on its argmax" if cfg.ce_weight else "")
        )
        + (
            f"; prompt positions weighted {cfg.prompt_weight}"
            if cfg.prompt_weight
            else "; response positions only"
        ),
        f"- AdamW, lr {cfg.lr} (warm-up {cfg.warmup_steps} steps, cosine to {cfg.lr * cfg.min_lr_ratio:g}), "
        f"gradient clip {cfg.grad_clip}, about {cfg.batch_tokens} padded tokens per step, seed {cfg.seed}",
        f"- {metrics['steps']} steps, {metrics['train_tokens']:,} tokens seen; time: data "
        f"{metrics['seconds']['data']:.0f} s, training {metrics['seconds']['train']:.0f} s",
    ]


def _measured(h: dict, h0: dict) -> list[str]:
    """The model card's held-out measurements, before and after training."""
    if not h:
        return ["No held-out prompts: no measurement.", ""]
    return [
        "Held-out, teacher-forced, response positions (greedy responses):",
        "",
        "| | top-1 agreement with the target | mean tokens accepted per 4-token draft |",
        "|---|---|---|",
        f"| before training | {h0['top1_agreement']:.3f} | {h0['mean_accepted_k4']:.2f} |",
        f"| after training | {h['top1_agreement']:.3f} | {h['mean_accepted_k4']:.2f} |",
        "",
        "By kind (after): " + ", ".join(f"{k} {v:.3f}" for k, v in h["by_kind"].items()) + ".",
        "",
    ]
