"""Run in ``.venv-vllm`` (speculators' own environment): build an EAGLE-3 head with speculators for a
target folder, save it, and record its logits for the target's features, for agentspec's head to be
held to (``tests/e2e/test_speculators_heads.py``).

    python speculators_reference.py TARGET_FOLDER OUT_FOLDER OPTIONS_JSON

OPTIONS_JSON: layers (the head's decoder layers), aux (target layer ids), draft_vocab (None: the
target's), norm_before_residual, norm_before_fc, fc_norm, norm_output. Writes OUT/head (the folder
``save_pretrained`` makes) and OUT/reference.pt: ids [T + 1], features [T, k x H], and the lm_head's
draft-vocabulary logits of the first two training-time-test steps [T, Vd] each (step 1 fed the true
next tokens, as speculators' trainer does).
"""

import json
import sys
from pathlib import Path

import torch
from speculators.models.eagle3 import Eagle3DraftModel
from transformers import AutoModelForCausalLM


def main(target_dir: str, out_dir: str, options: dict) -> None:
    torch.manual_seed(options.get("seed", 0))
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    vocab = target.config.vocab_size
    size = options.get("draft_vocab") or vocab
    t2d = d2t = None
    if size < vocab:
        kept = torch.randperm(vocab)[:size].sort().values
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[kept] = True
        d2t = kept - torch.arange(size)
    head = Eagle3DraftModel.from_training_args(
        target.config,
        t2d=t2d,
        d2t=d2t,
        num_layers=options.get("layers", 1),
        draft_vocab_size=size,
        norm_before_residual=options.get("norm_before_residual", True),
        norm_before_fc=options.get("norm_before_fc", False),
        fc_norm=options.get("fc_norm", False),
        norm_output=options.get("norm_output", False),
        target_layer_ids=options["aux"],
        verifier_name_or_path=target_dir,
        draft_attn_impl="eager",
        ttt_steps=2,
    ).eval()
    with torch.no_grad():  # norms off their ones, so that each one's place shows in the logits
        for name, p in head.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    head.save_pretrained(str(Path(out_dir) / "head"))

    ids = torch.randint(0, vocab, (1, 13))
    with torch.no_grad():
        states = target(input_ids=ids, output_hidden_states=True).hidden_states
        features = torch.cat([states[i] for i in options["aux"]], dim=-1)[:, :-1]  # positions 0..T-1
        logits = []
        hook = head.lm_head.register_forward_hook(lambda m, i, o: logits.append(o[0].clone()))
        # speculators' pairing: features of position i beside the token at i + 1
        n = features.shape[1]
        head(features, ids[:, 1:], document_ids=torch.zeros(1, n, dtype=torch.long), ttt_steps=2)
        hook.remove()
    torch.save({"ids": ids[0], "features": features[0], "logits": logits}, Path(out_dir) / "reference.pt")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
