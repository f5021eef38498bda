"""Train an EAGLE-3 head with speculators' own model and loss, on a responses file; run in ``.venv-vllm``.

speculators (vllm-project/speculators) defines the heads' format and trains them, but pins a
transformers below agentspec's, so this script runs in vLLM's environment (``make vllm`` installs
speculators there) and imports nothing of agentspec. speculators' own data pipeline extracts the
target's features through vLLM; here they come from transformers' forward of the same target, by
prefill of the token ids ``agentspec.distill.responses`` keeps. The model, its training-time test and
its KL loss are speculators' (``Eagle3DraftModel.forward``, eager loss and attention: the fused ones
need Triton, which has no CPU backend); the loop (AdamW, cosine, packing) is this file's.

    python speculators_train.py TARGET_FOLDER RESPONSES OUT [--minutes 20] [--draft-vocab 8192]
        [--prompt-context 128] [--features-cache DIR]

The target's features come from its prefill in ``--feature-dtype`` (bfloat16 by default: 2.5x
float32's prefill rate on an AMX CPU, and the head reads bfloat16 features in vLLM and SGLang alike).
The loss and the curve count only the rows that predict a response token: a head drafts replies,
and the prompts' rows (chat templates, system prompts repeated across examples) are easy to predict
and would flatter both (the first head's curve read 2.96 over every row, 1.80 over replies alone).
A prompt enters the head's sequence as its last ``--prompt-context`` tokens, context for the reply's
rows; its features come from the target's prefill of the whole example.

Writes OUT (the head folder, ``save_pretrained``) and OUT/training.json: the recipe, and the learning
curve (held-out replies, teacher-forced: each training-time-test step's accuracy given the steps
before it were right, and the acceptance length they imply for ``--ttt-steps`` drafted tokens)
against the response tokens the loss has seen.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import random
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from speculators.losses.utils import resolve_loss_config
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
from transformers import AutoModelForCausalLM


def examples(path: str) -> list[dict]:
    with safe_open(path, "pt") as f:
        meta = json.loads(f.metadata()["examples"])
        ids, starts = f.get_tensor("ids").long(), f.get_tensor("starts")
        prompts = f.get_tensor("prompt_lengths")
    return [
        {"ids": ids[starts[i] : starts[i + 1]], "prompt": int(prompts[i]), "kind": kind, "heldout": heldout}
        for i, (_, kind, _, heldout) in enumerate(meta)
    ]


@torch.no_grad()
def features(target, ids: torch.Tensor, layers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the aux layers' residual streams side by side [T, k x H], the last layer's pre-norm output
    [T, H]) for one sequence: what vLLM hands speculators' trainer. The body alone runs (no LM head)."""
    captured = {}
    hook = target.model.norm.register_forward_pre_hook(lambda m, args: captured.update(last=args[0]))
    try:
        states = target.model(input_ids=ids[None].to(target.device), output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    aux = torch.cat([states[i][0] for i in layers], -1)
    return aux.to(torch.bfloat16).cpu(), captured["last"][0].to(torch.bfloat16).cpu()


def first_row(item: dict, context: int) -> int:
    """Where an example enters the head's sequence: ``context`` tokens before its response."""
    return max(0, item["prompt"] - context)


class Features:
    """The target's features of each example (``aux``, ``last``), from its ``first`` row: its
    ``--prompt-context`` tokens before the response (the prefill covers the whole example; the rows
    before ``first`` are not kept, they would be most of the memory). Computed when a batch first
    needs them, inside the time budget (a prefill costs about what training on the rows does, so an
    up-front pass over a large set would leave no time to train), kept in ``--features-cache`` (one
    file per layer set, dtype and context) for later runs on the same ids."""

    def __init__(self, target, layers: list[int], args: argparse.Namespace) -> None:
        self.target, self.layers, self.context = target, layers, args.prompt_context
        name = f"features-{'-'.join(map(str, layers))}-{args.feature_dtype}-ctx{self.context}.safetensors"
        self.path = Path(args.features_cache) / name if args.features_cache else None
        self.stored = load_file(str(self.path)) if self.path is not None and self.path.exists() else {}
        self.seconds, self.computed, self.reused = 0.0, 0, 0

    def fill(self, items: list[dict]) -> None:
        """Give each item its ``first``, ``aux`` and ``last`` (a prefill where none is kept)."""
        start = time.perf_counter()
        for item in items:
            if "aux" in item:
                continue
            item["first"] = first_row(item, self.context)
            key = hashlib.sha1(item["ids"].numpy().tobytes()).hexdigest()
            if f"{key}.aux" in self.stored:
                self.reused += 1
            else:
                aux, last = features(self.target, item["ids"], self.layers)
                self.stored[f"{key}.aux"], self.stored[f"{key}.last"] = (
                    aux[item["first"] :],
                    last[item["first"] :],
                )
                self.computed += 1
            item["aux"], item["last"] = self.stored[f"{key}.aux"], self.stored[f"{key}.last"]
        self.seconds += time.perf_counter() - start

    def save(self) -> None:
        if self.path is not None and self.computed:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            save_file(self.stored, str(self.path))


def pack(items: list[dict], budget: int, device: str = "cpu") -> dict:
    """Sequences back to back, each from its ``first`` token for at most ``budget`` tokens, shifted as
    speculators' ``shift_batch`` does (x_{i+1} with g_i), the loss on the rows whose predicted token
    (row r's is ids[r + 2]) is in the response."""
    parts: dict[str, list] = {k: [] for k in ("input_ids", "hidden_states", "verifier_last_hidden_states")}
    parts.update(position_ids=[], doc=[], loss_mask=[])
    for d, item in enumerate(items):
        first = item["first"]
        n = min(len(item["ids"]) - first, budget)
        parts["input_ids"].append(item["ids"][first + 1 : first + n])
        parts["hidden_states"].append(item["aux"][: n - 1].float())
        parts["verifier_last_hidden_states"].append(item["last"][1:n].float())
        parts["position_ids"].append(torch.arange(first + 1, first + n))
        parts["doc"].append(torch.full((n - 1,), d))
        parts["loss_mask"].append(torch.arange(first + 2, first + n + 1) >= item["prompt"])
    batch = {k: torch.cat(v)[None].to(device) for k, v in parts.items()}
    batch["document_ids"] = batch.pop("doc")
    return batch


def batches(items: list[dict], budget: int, context: int, rng: random.Random) -> list[list[dict]]:
    """Shuffled items packed into batches of at most ``budget`` tokens, each from ``context`` tokens
    before its response."""
    order = items[:]
    rng.shuffle(order)
    out, cur, size = [], [], 0
    for item in order:
        n = min(len(item["ids"]) - first_row(item, context), budget)
        if cur and size + n > budget:
            out.append(cur)
            cur, size = [], 0
        cur.append(item)
        size += n
    return out + ([cur] if cur else [])


@torch.no_grad()
def evaluate(head, held: list[dict], args: argparse.Namespace, loss_config) -> dict:
    """Each step's held-out accuracy given the steps before were right, and the acceptance length
    1 + a0 + a0 a1 + ... they imply (teacher-forced)."""
    head.eval()
    sums: dict[str, float] = {}
    for group in batches(held, args.batch_tokens, args.prompt_context, random.Random(0)):
        _, _, metrics = head(
            **pack(group, args.batch_tokens, args.device), ttt_steps=args.ttt_steps, loss_config=loss_config
        )
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + float(v)
    head.train()
    cond = [sums[f"cond_acc_{s}_sum"] / max(sums[f"cond_acc_{s}_total"], 1.0) for s in range(args.ttt_steps)]
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
    parser.add_argument(
        "--ttt-steps", type=int, default=4, help="training-time-test steps: the draft length it trains for"
    )
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument(
        "--eval-examples", type=int, default=160, help="held-out examples the curve reads (the first ones)"
    )
    parser.add_argument(
        "--prompt-context", type=int, default=128, help="prompt tokens kept before each response"
    )
    parser.add_argument("--init", help="a head folder to train on from (its vocabulary kept)")
    parser.add_argument(
        "--device", default="cpu", help="where the target and head run (cuda: the same loop on a GPU)"
    )
    parser.add_argument("--features-cache", help="a folder keeping the target's features between runs")
    parser.add_argument(
        "--feature-dtype", default="bfloat16", choices=("bfloat16", "float32"),
        help="the target's dtype for its features (kept in bfloat16 either way)",
    )  # fmt: skip
    return parser.parse_args()


def build_head(target, items: list[dict], args: argparse.Namespace):
    """speculators' head for ``target``: one layer, its draft vocabulary the ids most frequent in the
    training examples; or, with ``--init``, that head folder's (its weights and vocabulary)."""
    if args.init:
        return load_head(args.init, args.target)
    freq: dict[int, int] = {}
    for item in items:
        if not item["heldout"]:
            for t in item["ids"].tolist():
                freq[t] = freq.get(t, 0) + 1
    d2t, t2d = build_vocab_mappings_from_distribution(freq, args.draft_vocab, target.config.vocab_size)
    config = copy.deepcopy(target.config)  # the head's layers: the target's, one of them
    config.dtype = torch.float32  # trained in float32 whatever the features' dtype
    config.num_hidden_layers = 1
    layer_ids = [int(i) for i in args.layer_ids.split(",")] if args.layer_ids else None
    return Eagle3DraftModel.from_training_args(
        config, t2d=t2d, d2t=d2t, draft_vocab_size=args.draft_vocab, norm_before_residual=True,
        verifier_name_or_path=args.target, draft_attn_impl="eager", ttt_steps=args.ttt_steps,
        target_layer_ids=layer_ids,
    )  # fmt: skip


def load_head(folder: str, target: str):
    """A head folder, in float32 and eager attention, with the target's embeddings (the folder may
    leave them out) and its frozen weights (LM head rows, final norm) read from ``target``."""
    config = Eagle3SpeculatorConfig.from_pretrained(folder)
    config.transformer_layer_config._attn_implementation = "eager"
    config.speculators_config.verifier.name_or_path = target
    head = Eagle3DraftModel.from_pretrained(folder, config=config).float()
    head._load_verifier_weights(overwrite_embed_tokens=True)
    return head


def train(head, features: Features, train_items: list[dict], held: list[dict], args) -> dict:
    """AdamW over packed batches until the time budget (warm-up, then a cosine over the budget; the
    features a batch needs first are computed inside it), the held-out curve every ``--eval-every``
    steps: steps, epochs, seconds and the curve."""
    loss_config = resolve_loss_config("kl_div", "eager")
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    rng = random.Random(0)
    plan = batches(train_items, args.batch_tokens, args.prompt_context, rng)
    curve = [{"tokens": 0, **evaluate(head, held, args, loss_config)}]
    print(json.dumps(curve[-1]), flush=True)
    start = time.perf_counter()
    deadline, tokens, step, epoch, per_step = start + 60 * args.minutes, 0, 0, 0, 0.0
    while time.perf_counter() + per_step < deadline:
        if not plan:
            epoch += 1
            plan = batches(train_items, args.batch_tokens, args.prompt_context, rng)
        begun = time.perf_counter()
        frac = min(1.0, (begun - start) / (deadline - start))
        for g in opt.param_groups:
            g["lr"] = args.lr * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        group = plan.pop()
        features.fill(group)
        batch = pack(group, args.batch_tokens, args.device)
        _, loss, _ = head(**batch, ttt_steps=args.ttt_steps, loss_config=loss_config)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        tokens += int(batch["loss_mask"].sum())
        per_step = time.perf_counter() - begun
        if step % args.eval_every == 0:
            measured = evaluate(head, held, args, loss_config)
            curve.append({"tokens": tokens, "step": step, "loss": float(loss.detach()), **measured})
            print(json.dumps(curve[-1]), flush=True)
    curve.append({"tokens": tokens, "step": step, **evaluate(head, held, args, loss_config)})
    return {"steps": step, "epochs": epoch, "train_seconds": time.perf_counter() - start, "curve": curve}


def store(head, out: Path) -> None:
    """``save_pretrained`` in bfloat16, without the embedding table: it is the target's, frozen, and
    agentspec and vLLM both take the target's where a head folder has none (153 MB for SmolLM2 in
    float32, the trained weights 20 MB in bfloat16)."""
    head.to(torch.bfloat16).cpu().save_pretrained(str(out))
    weights = load_file(str(out / "model.safetensors"))
    weights.pop("embed_tokens.weight", None)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.py").unlink(missing_ok=True)  # speculators' config class source: no loader reads it
    config = json.loads((out / "config.json").read_text())
    config.pop("auto_map", None)  # it names that file
    (out / "config.json").write_text(json.dumps(config, indent=2))


def init_record(folder: str | None) -> dict | None:
    """What the ``--init`` head had seen: its folder and its own record's steps and tokens."""
    if folder is None:
        return None
    path = Path(folder) / "training.json"
    earlier = json.loads(path.read_text()) if path.exists() else {}
    last = (earlier.get("curve") or [{}])[-1]
    return {"folder": str(folder), "steps": earlier.get("steps"), "tokens": last.get("tokens"),
            "loss_rows": earlier.get("recipe", {}).get("loss_rows", "every row")}  # fmt: skip


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    dtype = getattr(torch, args.feature_dtype)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).eval().to(args.device)
    items = examples(args.responses)
    head = build_head(target, items, args).to(args.device)
    layers = head.config.eagle_aux_hidden_state_layer_ids
    train_items = [i for i in items if not i["heldout"]]
    held = [i for i in items if i["heldout"]][: args.eval_examples]
    features = Features(target, layers, args)
    features.fill(held)
    run = train(head, features, train_items, held, args)
    features.save()
    out = Path(args.out)
    store(head, out)
    record = {
        "recipe": {
            "model": "speculators Eagle3DraftModel, 1 layer, norm_before_residual, aux layers " + str(layers),
            "loss": f"speculators kl_div (eager), training-time test {args.ttt_steps} steps",
            "optimizer": f"AdamW lr {args.lr}, 20 warm-up steps, cosine to 0.1x in {args.minutes} min",
            "batch_tokens": args.batch_tokens,
            "loss_rows": f"response tokens only, after {args.prompt_context} prompt tokens of context",
            "draft_vocab": args.draft_vocab,
            "init": init_record(args.init),
            "features": f"the target's prefill in {args.feature_dtype}",
        },
        "data": {
            "responses": args.responses,
            "train_examples": len(train_items),
            "heldout_examples": len(held),
            "train_tokens": sum(len(i["ids"]) for i in train_items),
            "train_response_tokens": sum(len(i["ids"]) - i["prompt"] for i in train_items),
            "feature_seconds": features.seconds,
            "features_computed": features.computed,
            "features_reused": features.reused,
        },
        **run,
    }
    (out / "training.json").write_text(json.dumps(record, indent=1))
    print(json.dumps(run["curve"][-1]))


if __name__ == "__main__":
    main()
