"""Reading and writing a draft head in the ``speculators`` format (vllm-project/speculators), the folder
vLLM and SGLang load (see docs/speculators.md for every field).

A head folder:
    config.json          ``speculators_model_type`` ("eagle3", ...), the target layers it reads
                         (``eagle_aux_hidden_state_layer_ids``), its norm switches, ``draft_vocab_size``,
                         ``transformer_layer_config`` (its decoder layers' transformers config) and
                         ``speculators_config.verifier`` (the target it was trained for)
    model.safetensors    ``fc``, ``layers.*``, ``norm``, ``lm_head`` over the draft vocabulary with
                         ``d2t`` (draft id -> target id offset) and ``t2d`` (target ids kept), and a copy
                         of the target's ``embed_tokens``

The head shares the target's embeddings (the stored copy is checked and dropped: 113 MB for
SmolLM2-135M in float32) and, over the whole vocabulary, its LM head. Whatever does not fit the
target raises ``HeadFolderError`` naming the field before the pair is built.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from agentspec.drafters.block import BlockHead
from agentspec.drafters.eagle3 import Eagle3Head

log = logging.getLogger(__name__)

TYPE_KEY = "speculators_model_type"
WEIGHTS = "model.safetensors"
SUPPORTED = ("eagle3", "dflash", "dspark")
KNOWN = ("eagle3", "dflash", "dspark", "eagle", "mtp", "peagle", "xpress", "dflash2")
NORM_OPTIONS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


class HeadFolderError(ValueError):
    """A speculators folder that cannot draft for this target: the message names the field."""


def is_head_folder(source: Any) -> bool:
    """Is ``source`` a folder whose config.json names a ``speculators_model_type``?"""
    if not isinstance(source, (str, Path)):
        return False
    path = Path(source).expanduser() / "config.json"
    try:
        return TYPE_KEY in json.loads(path.read_text())
    except (OSError, ValueError):
        return False


def load_head(folder: str | Path, target) -> Eagle3Head | BlockHead:
    """The head in ``folder`` on ``target``'s embeddings (and LM head), on its device and dtype."""
    folder = Path(folder).expanduser()
    config = json.loads((folder / "config.json").read_text())
    kind = config.get(TYPE_KEY)
    if kind not in SUPPORTED:
        known = "a speculators type agentspec does not load yet" if kind in KNOWN else "an unknown type"
        raise HeadFolderError(
            f"{folder}: {TYPE_KEY} {kind!r} is {known}; agentspec loads {', '.join(SUPPORTED)}"
        )
    layer_config = _layer_config(folder, config, target)  # the config's checks before the weights' read
    _check_verifier(folder, config, target)
    state = _read_weights(folder)
    draft_ids = _draft_ids(folder, config, state, target)
    shared = {
        "embed": target.get_input_embeddings(),
        "head": target.get_output_embeddings(),
        "draft_ids": draft_ids,
        "own_lm_head": "lm_head.weight" in state,
        "vocab_size": target.get_output_embeddings().weight.shape[0],
    }
    if kind == "eagle3":
        layers = _feature_layers(folder, config, "eagle_aux_hidden_state_layer_ids", target)
        options = {name: bool(config.get(name, name == "norm_before_residual")) for name in NORM_OPTIONS}
        head = Eagle3Head(layer_config, layers, options=options, **shared)
    else:
        layers = _feature_layers(folder, config, "aux_hidden_state_layer_ids", target)
        options = _block_options(folder, config, shared["vocab_size"])
        head = BlockHead(kind, block_layer_config(folder, layer_config), layers, options=options, **shared)
    _check_embeddings(folder, state.pop("embed_tokens.weight", None), target)
    _load_state(folder, head, state)
    head.to(device=target.device, dtype=target.dtype)
    head.name_or_path = str(folder)
    return head.eval()


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = folder / WEIGHTS
    if not path.is_file():
        raise HeadFolderError(f"{folder}: no {WEIGHTS}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise HeadFolderError(
            f"{path}: not a readable safetensors file (corrupt or truncated): {exc}"
        ) from exc


def _layer_config(folder: Path, config: dict, target) -> Any:
    """The decoder layers' transformers config, checked against the target's width and vocabulary."""
    from transformers import AutoConfig

    raw = config.get("transformer_layer_config")
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise HeadFolderError(f"{folder}: transformer_layer_config is missing or has no model_type")
    raw = dict(raw)
    try:
        layer_config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    except (ValueError, KeyError, TypeError) as exc:
        raise HeadFolderError(f"{folder}: transformer_layer_config: {exc}") from exc
    width, vocab = target.config.hidden_size, target.get_output_embeddings().weight.shape[0]
    declared = config.get("target_hidden_size")
    if declared is not None and declared != width:
        raise HeadFolderError(
            f"{folder}: target_hidden_size {declared} is not the target's hidden size {width}"
        )
    for name, want in (("hidden_size", width), ("vocab_size", vocab)):
        if getattr(layer_config, name) != want:
            got = getattr(layer_config, name)
            raise HeadFolderError(
                f"{folder}: transformer_layer_config.{name} {got} is not the target's {want}"
            )
    return layer_config


def _feature_layers(folder: Path, config: dict, key: str, target) -> list[int]:
    """The target layers the head reads (the residual stream entering each), checked in range."""
    layers = config.get(key)
    n = target.config.num_hidden_layers
    if not isinstance(layers, list) or not layers or not all(isinstance(i, int) for i in layers):
        raise HeadFolderError(f"{folder}: {key} must be a list of layer ids, got {layers!r}")
    if bad := [i for i in layers if not 0 <= i < n]:
        # id n (speculators allows it) is the last layer's output before the final norm, which the
        # passes do not keep
        raise HeadFolderError(f"{folder}: {key} {bad} out of range for a target of {n} layers (0..{n - 1})")
    return layers


BLOCK_OPTIONS = (
    "block_size", "mask_token_id", "sample_from_anchor", "markov_rank", "markov_head_type",
    "enable_confidence_head", "confidence_head_with_markov",
)  # fmt: skip


def _block_options(folder: Path, config: dict, vocab: int) -> dict:
    """A DFlash or DSpark folder's block options, checked."""
    options = {name: config[name] for name in BLOCK_OPTIONS if config.get(name) is not None}
    block, mask = options.get("block_size"), options.get("mask_token_id")
    if not isinstance(block, int) or block < 2:
        raise HeadFolderError(f"{folder}: block_size must be an integer of at least 2, got {block!r}")
    if not isinstance(mask, int) or not 0 <= mask < vocab:
        raise HeadFolderError(f"{folder}: mask_token_id must be a token id in [0, {vocab}), got {mask!r}")
    if config.get(TYPE_KEY) == "dspark":
        rank = options.get("markov_rank")
        if not isinstance(rank, int) or rank < 1:
            raise HeadFolderError(f"{folder}: markov_rank must be a positive integer, got {rank!r}")
        if options.get("markov_head_type", "vanilla") not in ("vanilla", "gated", "rnn"):
            raise HeadFolderError(f"{folder}: markov_head_type {options['markov_head_type']!r} is unknown")
    return options


def block_layer_config(folder: Path | str, layer_config: Any) -> Any:
    """The Qwen3 config of a block head's layers (q/k-normed whatever the target's family), from its
    ``transformer_layer_config``; a one-row embedding table (the head embeds with the target's)."""
    from transformers import Qwen3Config

    if any(kind != "full_attention" for kind in getattr(layer_config, "layer_types", None) or []):
        raise HeadFolderError(
            f"{folder}: transformer_layer_config.layer_types: sliding-window layers are not supported"
        )
    heads = layer_config.num_attention_heads
    config = Qwen3Config(
        vocab_size=1,
        hidden_size=layer_config.hidden_size,
        intermediate_size=layer_config.intermediate_size,
        num_hidden_layers=layer_config.num_hidden_layers,
        num_attention_heads=heads,
        num_key_value_heads=layer_config.num_key_value_heads,
        head_dim=getattr(layer_config, "head_dim", None) or layer_config.hidden_size // heads,
        hidden_act=layer_config.hidden_act,
        rms_norm_eps=layer_config.rms_norm_eps,
        rope_parameters=layer_config.rope_parameters,
        attention_bias=getattr(layer_config, "attention_bias", False),
        max_position_embeddings=layer_config.max_position_embeddings,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )
    config._attn_implementation = "sdpa"
    return config


def _draft_ids(folder: Path, config: dict, state: dict, target) -> torch.Tensor | None:
    """Each draft id's target id (``arange + d2t``), checked; None for a head over the whole vocabulary."""
    vocab = target.get_output_embeddings().weight.shape[0]
    size = config.get("draft_vocab_size", vocab)
    d2t, t2d = state.pop("d2t", None), state.pop("t2d", None)
    if d2t is None:
        if size != vocab:
            raise HeadFolderError(f"{folder}: draft_vocab_size {size} needs d2t and t2d in {WEIGHTS}")
        return None
    if d2t.shape != (size,):
        raise HeadFolderError(f"{folder}: d2t has shape {list(d2t.shape)}, not [draft_vocab_size={size}]")
    ids = torch.arange(size) + d2t.long()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab or len(set(ids.tolist())) != size:
        raise HeadFolderError(
            f"{folder}: d2t maps draft ids outside the target vocabulary [0, {vocab}) or twice"
        )
    if t2d is not None:
        if t2d.shape != (vocab,) or int(t2d.sum()) != size:
            raise HeadFolderError(
                f"{folder}: t2d has shape {list(t2d.shape)} and {int(t2d.sum())} ids set, "
                f"not [{vocab}] with draft_vocab_size={size}"
            )
        if not bool(t2d.bool()[ids].all()):
            raise HeadFolderError(f"{folder}: d2t and t2d disagree on the draft vocabulary")
    return ids


def _check_verifier(folder: Path, config: dict, target) -> None:
    """A warning when the head names another verifier than ``target`` (the output stays the target's;
    few drafts would be accepted)."""
    verifier = (config.get("speculators_config") or {}).get("verifier") or {}
    name = Path(str(verifier.get("name_or_path") or "")).name
    mine = Path(str(getattr(target.config, "name_or_path", "") or "")).name
    archs, my_archs = verifier.get("architectures"), getattr(target.config, "architectures", None)
    if name and mine and name.lower() != mine.lower():
        log.warning("%s: a head trained for %r drafts for %r", folder, name, mine)
    if archs and my_archs and list(archs) != list(my_archs):
        log.warning("%s: a head trained for a %s drafts for a %s", folder, archs, my_archs)


def _check_embeddings(folder: Path, stored: torch.Tensor | None, target) -> None:
    embed = target.get_input_embeddings().weight
    if stored is None:
        return
    if stored.shape != embed.shape:
        raise HeadFolderError(
            f"{folder}: embed_tokens has shape {list(stored.shape)}; the target's is {list(embed.shape)}"
        )
    if not torch.allclose(stored.float(), embed.detach().float().cpu(), atol=1e-2, rtol=1e-2):
        log.warning("%s: the head's embed_tokens are not the target's: it drafts with the target's", folder)


def _load_state(folder: Path, head: Eagle3Head | BlockHead, state: dict) -> None:
    own = head.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise HeadFolderError(f"{folder}: {WEIGHTS} does not fit its config: {missing=} {unexpected=}")
    for name, tensor in state.items():
        if tensor.shape != own[name].shape:
            wide = " (layers x hidden size wide)" if name == "fc.weight" else ""
            shape = list(own[name].shape)
            raise HeadFolderError(
                f"{folder}: {name} has shape {list(tensor.shape)}, the config makes it {shape}{wide}"
            )
    head.load_state_dict(state)
