"""Random speculators heads for the tests: built for a target (``new_eagle3``, ``new_block_head``) and
written as the folders vLLM and ``agentspec.head_folder`` load (``save_head``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from agentspec.drafters.block import BlockHead
from agentspec.drafters.eagle import with_layers
from agentspec.drafters.eagle3 import Eagle3Head
from agentspec.head_folder import TYPE_KEY, WEIGHTS, block_layer_config


def save_head(
    head: Eagle3Head | BlockHead, folder: str | Path, *, verifier: Any, with_embeddings: bool = False
) -> Path:
    """Write ``head`` as a speculators folder (what vLLM loads with ``method=`` its type).

    ``verifier``: the target (its config names it); ``with_embeddings``: store a copy of its embeddings
    (as speculators does for EAGLE-3; agentspec and vLLM share the target's without it).
    """
    from safetensors.torch import save_file

    folder = Path(folder).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}
    vocab = head.vocab_size
    if head.draft_ids is not None:
        ids = head.draft_ids.cpu()
        state["d2t"] = ids - torch.arange(len(ids))
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        state["t2d"] = t2d
    if with_embeddings:
        state["embed_tokens.weight"] = head.embed.weight.detach().cpu().to(head.dtype).contiguous()
    save_file(state, str(folder / WEIGHTS))
    layer_config = head.config.to_dict()
    layer_config.pop("_attn_implementation_autoset", None)
    layer_config["vocab_size"] = vocab  # a block head's own config has a one-row table
    kind = head.architecture
    config = {
        "architectures": [ARCHITECTURES[kind]],
        TYPE_KEY: kind,
        "speculators_version": "0.9.0",
        "draft_vocab_size": vocab if head.draft_ids is None else len(head.draft_ids),
        **_format_fields(head),
        "target_hidden_size": None,
        "tie_word_embeddings": False,
        "dtype": str(head.dtype).removeprefix("torch."),
        "transformer_layer_config": layer_config,
        "speculators_config": {
            "algorithm": kind,
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": getattr(head, "drafts_per_block", 3),
                    "accept_tolerance": 0.0,
                    "verifier_accept_k": 1,
                }
            ],
            "verifier": {
                "architectures": list(getattr(verifier.config, "architectures", None) or []),
                "name_or_path": str(getattr(verifier.config, "name_or_path", "") or ""),
            },
        },
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


ARCHITECTURES = {"eagle3": "Eagle3DraftModel", "dflash": "DFlashDraftModel", "dspark": "DSparkDraftModel"}


def _format_fields(head: Eagle3Head | BlockHead) -> dict:
    """The config.json fields of ``head``'s type."""
    if isinstance(head, Eagle3Head):
        return {
            "eagle_aux_hidden_state_layer_ids": list(head.feature_layers),
            "norm_before_residual": head.norm_before_residual,
            "norm_before_fc": hasattr(head, "input_norm"),
            "fc_norm": hasattr(head, "fc_norm"),
            "norm_output": head.norm_output,
            "embed_requires_grad": False,
        }
    fields = {
        "aux_hidden_state_layer_ids": list(head.feature_layers),
        "block_size": head.block_size,
        "mask_token_id": head.mask_token_id,
        "sample_from_anchor": head.sample_from_anchor,
        "sliding_window_non_causal": False,
    }
    if head.markov_type is not None:
        fields.update(
            markov_rank=head.markov_head.markov_w1.embedding_dim,
            markov_head_type=head.markov_type,
            enable_confidence_head=hasattr(head, "confidence_head"),
            confidence_head_with_markov=head.with_markov,
        )
    return fields


def new_eagle3(
    target, feature_layers, *, draft_ids: torch.Tensor | None = None, layers: int = 1
) -> Eagle3Head:
    """A randomly initialised EAGLE-3 head for ``target`` (its family's layers), on its device and dtype."""
    layer_config = with_layers(target.config, layers)
    head = Eagle3Head(
        layer_config,
        feature_layers,
        target.get_input_embeddings(),
        target.get_output_embeddings(),
        options={"norm_before_residual": True},
        draft_ids=draft_ids,
        vocab_size=target.get_output_embeddings().weight.shape[0],
    )
    return head.to(device=target.device, dtype=target.dtype)


def new_block_head(
    target, kind: str, feature_layers, *, block_size: int = 4, mask_token_id: int = 0, markov_rank: int = 8,
    draft_ids: torch.Tensor | None = None, layers: int = 1, **options,
) -> BlockHead:  # fmt: skip
    """A randomly initialised DFlash or DSpark head for ``target``, on its device and dtype."""
    layer_config = with_layers(target.config, layers)
    options = {
        "block_size": block_size,
        "mask_token_id": mask_token_id,
        "markov_rank": markov_rank,
        **options,
    }
    head = BlockHead(
        kind,
        block_layer_config("new", layer_config),
        feature_layers,
        target.get_input_embeddings(),
        target.get_output_embeddings(),
        options=options,
        draft_ids=draft_ids,
        own_lm_head=draft_ids is not None,
        vocab_size=target.get_output_embeddings().weight.shape[0],
    )
    return head.to(device=target.device, dtype=target.dtype)
