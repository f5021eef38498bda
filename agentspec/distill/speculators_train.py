"""Train an EAGLE-3 head with speculators' own model and loss, on a responses file; run in ``.venv-vllm``.

speculators (vllm-project/speculators) defines the heads' format and trains them, but pins a
transformers below agentspec's, so this script runs in vLLM's environment (``make vllm`` installs
speculators there) and imports nothing of agentspec. speculators' own data pipeline extracts the
target's features through vLLM; here they come from transformers' forward of the same target, by
prefill of the token ids ``agentspec.distill.responses`` keeps. The model, its training-time test and
its KL loss are speculators' (``Eagle3DraftModel.forward``, eager loss and attention: the fused ones
need Triton, which has no CPU backend); the loop (AdamW, cosine, packing) is this file's.

    python speculators_train.py TARGET_FOLDER RESPONSES OUT [--minutes 20] [--draft-vocab 8192]

Writes OUT (the head folder, ``save_pretrained``) and OUT/training.json: the recipe, and the learning
curve (held-out, teacher-forced: each training-time-test step's accuracy given the steps before it
were right, and the acceptance length they imply for 3 drafted tokens) against tokens seen.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import time
from pathlib import Path

import torch
from safetensors import safe_open
from speculators.losses.utils import resolve_loss_config
from speculators.models.eagle3 import Eagle3DraftModel
from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
from transformers import AutoModelForCausalLM

TTT_STEPS = 3


def examples(path: str) -> list[dict]:
    with safe_open(path, "pt") as f:
        meta = json.loads(f.metadata()["examples"])
        ids, starts = f.get_tensor("ids").long(), f.get_tensor("starts")
    return [
        {"ids": ids[starts[i] : starts[i + 1]], "kind": kind, "heldout": bool(heldout)}
        for i, (_, kind, _, heldout) in enumerate(meta)
    ]


@torch.no_grad()
def features(target, ids: torch.Tensor, layers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the aux layers' residual streams side by side [T, k x H], the last layer's pre-norm output
    [T, H]) for one sequence: what vLLM hands speculators' trainer."""
    captured = {}
    hook = target.model.norm.register_forward_pre_hook(lambda m, args: captured.update(last=args[0]))
    try:
        states = target(input_ids=ids[None], output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    return torch.cat([states[i][0] for i in layers], -1).to(torch.bfloat16), captured["last"][0].to(
        torch.bfloat16
    )


def pack(items: list[dict]) -> dict:
    """Sequences back to back, each shifted as speculators' ``shift_batch`` does (x_{i+1} with g_i)."""
    parts = {
        "input_ids": [],
        "hidden_states": [],
        "verifier_last_hidden_states": [],
        "position_ids": [],
        "doc": [],
    }
    for d, item in enumerate(items):
        n = len(item["ids"])
        parts["input_ids"].append(item["ids"][1:])
        parts["hidden_states"].append(item["aux"][:-1].float())
        parts["verifier_last_hidden_states"].append(item["last"][1:].float())
        parts["position_ids"].append(torch.arange(1, n))
        parts["doc"].append(torch.full((n - 1,), d))
    batch = {k: torch.cat(v)[None] for k, v in parts.items()}
    batch["document_ids"] = batch.pop("doc")
    batch["loss_mask"] = torch.ones_like(batch["input_ids"], dtype=torch.bool)
    return batch


def batches(items: list[dict], budget: int, rng: random.Random) -> list[list[dict]]:
    order = items[:]
    rng.shuffle(order)
    out, cur, size = [], [], 0
    for item in order:
        n = min(len(item["ids"]), budget)
        if cur and size + n > budget:
            out.append(cur)
            cur, size = [], 0
        cur.append({**item, "ids": item["ids"][:n], "aux": item["aux"][:n], "last": item["last"][:n]})
        size += n
    return out + ([cur] if cur else [])


@torch.no_grad()
def evaluate(head, held: list[dict], budget: int, loss_config) -> dict:
    """Each step's held-out accuracy given the steps before were right, and the acceptance length
    1 + a0 + a0 a1 + a0 a1 a2 they imply (teacher-forced)."""
    head.eval()
    sums: dict[str, float] = {}
    for group in batches(held, budget, random.Random(0)):
        _, _, metrics = head(**pack(group), ttt_steps=TTT_STEPS, loss_config=loss_config)
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + float(v)
    head.train()
    cond = [sums[f"cond_acc_{s}_sum"] / max(sums[f"cond_acc_{s}_total"], 1.0) for s in range(TTT_STEPS)]
    length, run = 1.0, 1.0
    for a in cond:
        run *= a
        length += run
    return {"cond_acc": cond, "acceptance_length": length}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target")
    parser.add_argument("responses")
    parser.add_argument("out")
    parser.add_argument("--minutes", type=float, default=20.0, help="the training loop's time budget")
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument(
        "--layer-ids", help="the target layers the head reads, e.g. 2,15,27 (default: speculators')"
    )
    parser.add_argument("--batch-tokens", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval-every", type=int, default=25)
    return parser.parse_args()


def build_head(target, items: list[dict], args: argparse.Namespace):
    """speculators' head for ``target``: one layer, its draft vocabulary the ids most frequent in the
    training examples."""
    freq: dict[int, int] = {}
    for item in items:
        if not item["heldout"]:
            for t in item["ids"].tolist():
                freq[t] = freq.get(t, 0) + 1
    d2t, t2d = build_vocab_mappings_from_distribution(freq, args.draft_vocab, target.config.vocab_size)
    config = copy.deepcopy(target.config)  # the head's layers: the target's, one of them
    config.num_hidden_layers = 1
    layer_ids = [int(i) for i in args.layer_ids.split(",")] if args.layer_ids else None
    return Eagle3DraftModel.from_training_args(
        config, t2d=t2d, d2t=d2t, draft_vocab_size=args.draft_vocab, norm_before_residual=True,
        verifier_name_or_path=args.target, draft_attn_impl="eager", ttt_steps=TTT_STEPS,
        target_layer_ids=layer_ids,
    )  # fmt: skip


def train(head, train_items: list[dict], held: list[dict], args: argparse.Namespace) -> dict:
    """AdamW over packed batches until the time budget (warm-up, then a cosine over the budget), the
    held-out curve every ``--eval-every`` steps: steps, epochs, seconds and the curve."""
    loss_config = resolve_loss_config("kl_div", "eager")
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    rng = random.Random(0)
    plan = batches(train_items, args.batch_tokens, rng)
    curve = [{"tokens": 0, **evaluate(head, held, args.batch_tokens, loss_config)}]
    print(json.dumps(curve[-1]), flush=True)
    start = time.perf_counter()
    deadline, tokens, step, epoch, per_step = start + 60 * args.minutes, 0, 0, 0, 0.0
    while time.perf_counter() + per_step < deadline:
        if not plan:
            epoch += 1
            plan = batches(train_items, args.batch_tokens, rng)
        begun = time.perf_counter()
        frac = min(1.0, (begun - start) / (deadline - start))
        for g in opt.param_groups:
            g["lr"] = args.lr * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        batch = pack(plan.pop())
        _, loss, _ = head(**batch, ttt_steps=TTT_STEPS, loss_config=loss_config)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        tokens += batch["input_ids"].shape[1]
        per_step = time.perf_counter() - begun
        if step % args.eval_every == 0:
            measured = evaluate(head, held, args.batch_tokens, loss_config)
            curve.append({"tokens": tokens, "step": step, "loss": float(loss), **measured})
            print(json.dumps(curve[-1]), flush=True)
    curve.append({"tokens": tokens, "step": step, **evaluate(head, held, args.batch_tokens, loss_config)})
    return {"steps": step, "epochs": epoch, "train_seconds": time.perf_counter() - start, "curve": curve}


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    items = examples(args.responses)
    head = build_head(target, items, args)
    layers = head.config.eagle_aux_hidden_state_layer_ids
    t0 = time.perf_counter()
    for item in items:
        item["aux"], item["last"] = features(target, item["ids"], layers)
    feature_seconds = time.perf_counter() - t0
    train_items = [i for i in items if not i["heldout"]]
    held = [i for i in items if i["heldout"]]
    run = train(head, train_items, held, args)
    out = Path(args.out)
    head.save_pretrained(str(out))
    record = {
        "recipe": {
            "model": "speculators Eagle3DraftModel, 1 layer, norm_before_residual, aux layers " + str(layers),
            "loss": f"speculators kl_div (eager), training-time test {TTT_STEPS} steps",
            "optimizer": f"AdamW lr {args.lr}, 20 warm-up steps, cosine to 0.1x in {args.minutes} min",
            "batch_tokens": args.batch_tokens,
            "draft_vocab": args.draft_vocab,
        },
        "data": {
            "responses": args.responses,
            "train_examples": len(train_items),
            "heldout_examples": len(held),
            "train_tokens": sum(len(i["ids"]) for i in train_items),
            "feature_seconds": feature_seconds,
        },
        **run,
    }
    (out / "training.json").write_text(json.dumps(record, indent=1))
    print(json.dumps(run["curve"][-1]))


if __name__ == "__main__":
    main()
