"""Run in ``.venv-vllm`` (speculators' own environment): build a head with speculators for a target
folder, save it, and record its own module's outputs for the target's features, for agentspec's head
to be held to (``tests/e2e/test_speculators_heads.py``).

    python speculators_reference.py TARGET_FOLDER OUT_FOLDER OPTIONS_JSON

OPTIONS_JSON: kind ("eagle3", "dflash", "dspark"), layers (the head's decoder layers), aux (target
layer ids), draft_vocab (None: the target's), layer_family ("llama": Llama layers whatever the
target's family); eagle3: norm_before_residual, norm_before_fc, fc_norm,
norm_output; dflash and dspark: block_size, mask_token_id, sample_from_anchor, and dspark's
markov_rank, markov_head_type. Writes OUT/head (the folder ``save_pretrained`` makes) and
OUT/reference.pt with ids, features [T, k x H] and:
  eagle3         the lm_head's draft-vocabulary logits of the first two training-time-test steps [T, Vd]
                 (step 1 fed the true next tokens, as speculators' trainer does)
  dflash/dspark  the block anchored at ``anchor``: its logits [B, Vd] (dspark: with the Markov bias on
                 the true previous tokens) and dspark's confidence logits [B]
"""

import json
import sys
from pathlib import Path

import torch
from speculators.models.dflash import DFlashDraftModel
from speculators.models.dspark import DSparkDraftModel
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
    kind = options.get("kind", "eagle3")
    head = build(kind, target, t2d, d2t, size, target_dir, options)
    with torch.no_grad():  # norms off their ones, so that each one's place shows in the logits
        for name, p in head.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    head.save_pretrained(str(Path(out_dir) / "head"))
    if kind == "eagle3":
        eagle3_reference(head, target, vocab, options, Path(out_dir))
    else:
        block_reference(head, target, vocab, options, Path(out_dir))


def build(kind, target, t2d, d2t, size, target_dir, options):
    layer_config = target.config
    if options.get("layer_family") == "llama":  # a Llama layer on another family's target, as
        from transformers import LlamaConfig  # published heads for Qwen2.5 targets have

        c = target.config
        layer_config = LlamaConfig(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
            num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads, rms_norm_eps=c.rms_norm_eps,
            max_position_embeddings=c.max_position_embeddings, rope_parameters=c.rope_parameters,
        )  # fmt: skip
    if kind == "eagle3":
        return Eagle3DraftModel.from_training_args(
            layer_config,
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
    import copy

    layer_config = copy.deepcopy(layer_config)
    layer_config.num_hidden_layers = options.get("layers", 1)  # the draft's layers (speculators' train.py)
    if getattr(layer_config, "layer_types", None):
        layer_config.layer_types = layer_config.layer_types[: layer_config.num_hidden_layers]
    cls = DFlashDraftModel if kind == "dflash" else DSparkDraftModel
    extra = {
        "markov_rank": options.get("markov_rank"),
        "markov_head_type": options.get("markov_head_type", "vanilla"),
    }
    head = cls.from_training_args(
        layer_config,
        t2d=t2d,
        d2t=d2t,
        draft_vocab_size=size,
        block_size=options["block_size"],
        mask_token_id=options["mask_token_id"],
        sample_from_anchor=options.get("sample_from_anchor"),
        target_layer_ids=options["aux"],
        verifier_name_or_path=target_dir,
        draft_attn_impl="eager",
        **(extra if kind == "dspark" else {}),
    ).eval()
    with torch.no_grad():  # the Markov factors start near zero: large enough to show here
        for name, p in head.named_parameters():
            if "markov" in name or "confidence" in name:
                p.normal_(0, 0.3)
    return head


def block_reference(head, target, vocab, options, out: Path) -> None:
    """The block anchored at position ``anchor`` of 24 random ids, through speculators' backbone."""
    block, anchor, n = options["block_size"], options.get("anchor", 14), 24
    ids = torch.randint(0, vocab, (1, n))
    with torch.no_grad():
        states = target(input_ids=ids, output_hidden_states=True).hidden_states
        features = torch.cat([states[i] for i in options["aux"]], dim=-1)
        loss_mask = torch.zeros(1, n, dtype=torch.long)
        loss_mask[0, anchor] = 1  # the one anchor speculators' selection can pick
        hidden, logits, _, _, _ = head._backbone_forward(
            features, ids, loss_mask, states[-1], torch.zeros(1, n, dtype=torch.long), max_anchors=1
        )
        result = {"ids": ids[0], "features": features[0], "anchor": anchor, "logits": logits[0]}
        if isinstance(head, DSparkDraftModel):
            tokens = ids[0, anchor : anchor + block][None]
            prev = tokens if head.config.sample_from_anchor else torch.cat([tokens[:, :1], tokens[:, :-1]], 1)
            emb = head.markov_head.prev_embeddings(prev)
            bias = head.markov_head.block_bias(prev_token_ids=prev, hidden_states=hidden, prev_emb=emb)
            conf = (
                torch.cat([hidden, emb.to(hidden.dtype)], -1)
                if head.config.confidence_head_with_markov
                else hidden
            )
            result.update(
                logits=(logits + bias)[0], prev=prev[0], confidence=head.confidence_head(conf).reshape(-1)
            )
    torch.save(result, out / "reference.pt")


def eagle3_reference(head, target, vocab, options, out: Path) -> None:
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
    torch.save({"ids": ids[0], "features": features[0], "logits": logits}, out / "reference.pt")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
