"""The draft: a few decoder layers of the target's own architecture, on the target's embeddings.

The draft is a standard transformers causal LM built from the target's config with fewer layers,
each initialised from a chosen target layer (``init_layers``), its final norm from the target's.
Its input embeddings and LM head *are* the target's modules (shared, frozen): for SmolLM2-135M they
are 28M of the draft's 35M parameters, so a draft folder stores only its own layers and norm
(safetensors) and is completed from the target when loaded. ``save_draft`` writes the folder
format that ``agentspec.draft_folder`` reads (and describes).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from agentspec.draft_folder import FORMAT, MARKER, VOCAB_KEY, attach_shared, fingerprint, shared_keys
from agentspec.drafters.eagle import EAGLE_ARCHITECTURE, is_eagle, with_layers


def draft_vocab(token_lists, vocab_size: int, size: int) -> torch.Tensor:
    """The ``size`` ids a draft's head keeps: those most frequent in ``token_lists``, then the lowest.

    Counts come from the training data (prompts and the target's responses). Ids never seen are
    filled in from the lowest up: BPE vocabularies number tokens roughly in the order their merges
    were learned, most frequent first. Measured on the first distillation run's data (128 training
    prompts): 8,192 ids chosen so covered 94.8% of the held-out responses' tokens, against 86.8% for
    the 2,301 ids seen and 87.9% for the lowest 8,192 ids alone.
    """
    if size >= vocab_size:
        return torch.arange(vocab_size)
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids in token_lists:
        ids = torch.as_tensor(ids, dtype=torch.long)
        counts += torch.bincount(ids[(ids >= 0) & (ids < vocab_size)], minlength=vocab_size)
    # most frequent first; among equal counts (zero included) the lower id first
    order = torch.sort(-counts, stable=True).indices
    return order[:size].sort().values


def build_student(target, n_layers: int, init_layers: tuple[int, ...]):
    """A draft of ``n_layers`` layers copied from the target's ``init_layers``, sharing its embeddings."""
    from transformers import AutoModelForCausalLM

    n_target = target.config.num_hidden_layers
    if len(init_layers) != n_layers:
        raise ValueError(f"init_layers: {len(init_layers)} indices for n_layers={n_layers}")
    if bad := [i for i in init_layers if not 0 <= i < n_target]:
        raise ValueError(f"init_layers: {bad} out of range for a target of {n_target} layers")
    student = AutoModelForCausalLM.from_config(with_layers(target.config, n_layers))
    student.to(device=target.device, dtype=target.dtype)
    with torch.no_grad():
        # weights only: each draft layer keeps its own layer_idx (its slot in the KV cache)
        for dst, src in zip(student.model.layers, init_layers):
            dst.load_state_dict(target.model.layers[src].state_dict())
        student.model.norm.load_state_dict(target.model.norm.state_dict())
    attach_shared(student, target)
    return student


def build_eagle(target, init_layer: int | None):
    """An EAGLE head for ``target`` (``agentspec.drafters.eagle``): fc, one decoder layer, norm.

    The layer starts as a copy of target layer ``init_layer`` (None: random), the norm as the
    target's final norm, and ``fc`` as [feature, embedding] -> feature + embedding.
    """
    from agentspec.drafters.eagle import EagleHead, eagle_config

    n_target = target.config.num_hidden_layers
    if init_layer is not None and not 0 <= init_layer < n_target:
        raise ValueError(f"init_layers: {init_layer} out of range for a target of {n_target} layers")
    head = EagleHead(
        eagle_config(target.config), target.get_input_embeddings(), target.get_output_embeddings()
    )
    d = head.config.hidden_size
    with torch.no_grad():
        if init_layer is not None:
            head.decoder.layers[0].load_state_dict(target.model.layers[init_layer].state_dict())
        head.decoder.norm.load_state_dict(target.model.norm.state_dict())
        head.fc.weight.zero_()
        head.fc.weight[:, :d].copy_(torch.eye(d))
        head.fc.weight[:, d:].copy_(torch.eye(d))
        head.fc.bias.zero_()
    return head.to(device=target.device, dtype=target.dtype)


def own_state(student) -> dict[str, torch.Tensor]:
    """The draft's own tensors: its state dict without the shared embeddings and LM head."""
    skip = shared_keys(student) if not is_eagle(student) else set()  # an EAGLE head holds none
    return {k: v for k, v in student.state_dict().items() if k not in skip}


def trainable_parameters(student) -> list[torch.nn.Parameter]:
    if is_eagle(student):
        return list(student.parameters())
    skip = {id(p) for p in student.get_input_embeddings().parameters()}
    skip |= {id(p) for p in student.get_output_embeddings().parameters()}
    return [p for p in student.parameters() if id(p) not in skip]


def save_draft(
    student,
    folder: str | Path,
    *,
    card: str,
    target_name: str,
    info: dict | None = None,
    tokenizer: Any = None,
    vocab: torch.Tensor | None = None,
) -> Path:
    """Write a loadable draft folder (see the module docstring); return its path.

    The draft's own tensors are stored in float16 (half the bytes; loading casts them to the
    target's dtype). ``vocab``: the ids its LM head keeps (``draft_vocab``); None keeps them all.
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    embed = (student.embed if is_eagle(student) else student.get_input_embeddings()).weight
    head = student.get_output_embeddings().weight
    marker = {
        "format": FORMAT,
        "version": 1,
        "shares_embeddings_with": target_name,
        "embedding_shape": list(embed.shape),
        "lm_head_shape": list(head.shape),
        "tie_word_embeddings": bool(getattr(student.config, "tie_word_embeddings", False)),
        "embedding_fingerprint": fingerprint(embed),  # mean, std: warns on another target's
        "architecture": EAGLE_ARCHITECTURE if is_eagle(student) else "layers",
        "num_hidden_layers": student.config.num_hidden_layers,
        "weights_dtype": "float16",
        "draft_vocab": None if vocab is None else int(vocab.numel()),
        **(info or {}),
    }
    tensors = {
        k: v.detach().to("cpu", torch.float16 if v.is_floating_point() else v.dtype).contiguous()
        for k, v in own_state(student).items()
    }
    if vocab is not None:
        if vocab.numel() == 0 or int(vocab.min()) < 0 or int(vocab.max()) >= head.shape[0]:
            raise ValueError(f"vocab: ids must lie in [0, {head.shape[0]}) and not be empty")
        tensors[VOCAB_KEY] = vocab.detach().to("cpu", torch.int32).contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    student.config.to_json_file(str(folder / "config.json"))
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(str(folder))
    (folder / "README.md").write_text(card)
    # the marker last: a folder is recognised as a draft only once everything else is in place
    (folder / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
    return folder
