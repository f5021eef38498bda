"""The draft: a few decoder layers of the target's own architecture, on the target's embeddings.

The draft is a standard transformers causal LM built from the target's config with fewer layers,
each initialised from a chosen target layer (``init_layers``), its final norm from the target's.
Its input embeddings and LM head *are* the target's modules (shared, frozen): for SmolLM2-135M they
are 28M of the draft's 35M parameters, so a draft folder stores only its own layers and norm
(safetensors) and is completed from the target when loaded.

A draft folder:
    agentspec_draft.json   the marker: what the draft shares with which target, and its shapes
    config.json            the draft's transformers config (num_hidden_layers = the draft's)
    model.safetensors      the draft's own tensors, without embeddings and LM head
    tokenizer files        the target's, so the pair's tokenizer check applies as for any draft
    README.md              the model card
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

MARKER = "agentspec_draft.json"
FORMAT = "agentspec-distilled-draft"


def is_draft_folder(source: Any) -> bool:
    """Is ``source`` a folder written by ``save_draft``?"""
    if not isinstance(source, (str, Path)):
        return False
    return (Path(source).expanduser() / MARKER).is_file()


def _draft_config(target_config, n_layers: int):
    config = copy.deepcopy(target_config)
    config.num_hidden_layers = n_layers
    if getattr(config, "layer_types", None):  # per-layer attention kinds (sliding window, ...)
        config.layer_types = list(config.layer_types[:n_layers])
    return config


def shared_keys(model) -> set[str]:
    """State-dict keys of the input embeddings and the LM head (the tensors shared with the target)."""
    shared = {id(model.get_input_embeddings()), id(model.get_output_embeddings())}
    return {
        f"{name}.{pname}"
        for name, module in model.named_modules()
        if id(module) in shared
        for pname, _ in module.named_parameters(recurse=False)
    }


def attach_shared(student, target) -> None:
    """Make ``student`` use the target's embedding and LM-head modules (same tensors, frozen)."""
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    for module in (embed, head):
        module.requires_grad_(False)
    student.set_input_embeddings(embed)
    student.set_output_embeddings(head)


def build_student(target, n_layers: int, init_layers: tuple[int, ...]):
    """A draft of ``n_layers`` layers copied from the target's ``init_layers``, sharing its embeddings."""
    from transformers import AutoModelForCausalLM

    n_target = target.config.num_hidden_layers
    if len(init_layers) != n_layers:
        raise ValueError(f"init_layers: {len(init_layers)} indices for n_layers={n_layers}")
    if bad := [i for i in init_layers if not 0 <= i < n_target]:
        raise ValueError(f"init_layers: {bad} out of range for a target of {n_target} layers")
    student = AutoModelForCausalLM.from_config(_draft_config(target.config, n_layers))
    student.to(device=target.device, dtype=target.dtype)
    with torch.no_grad():
        # weights only: each draft layer keeps its own layer_idx (its slot in the KV cache)
        for dst, src in zip(student.model.layers, init_layers):
            dst.load_state_dict(target.model.layers[src].state_dict())
        student.model.norm.load_state_dict(target.model.norm.state_dict())
    attach_shared(student, target)
    return student


def own_state(student) -> dict[str, torch.Tensor]:
    """The draft's own tensors: its state dict without the shared embeddings and LM head."""
    skip = shared_keys(student)
    return {k: v for k, v in student.state_dict().items() if k not in skip}


def trainable_parameters(student) -> list[torch.nn.Parameter]:
    skip = {id(p) for p in student.get_input_embeddings().parameters()}
    skip |= {id(p) for p in student.get_output_embeddings().parameters()}
    return [p for p in student.parameters() if id(p) not in skip]


def _fingerprint(weight: torch.Tensor) -> list[float]:
    w = weight.detach().double()
    return [float(w.mean()), float(w.std())]


def save_draft(
    student,
    folder: str | Path,
    *,
    card: str,
    target_name: str,
    info: dict | None = None,
    tokenizer: Any = None,
) -> Path:
    """Write a loadable draft folder (see the module docstring); return its path."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    embed = student.get_input_embeddings().weight
    head = student.get_output_embeddings().weight
    marker = {
        "format": FORMAT,
        "version": 1,
        "shares_embeddings_with": target_name,
        "embedding_shape": list(embed.shape),
        "lm_head_shape": list(head.shape),
        "tie_word_embeddings": bool(getattr(student.config, "tie_word_embeddings", False)),
        "embedding_fingerprint": _fingerprint(embed),  # mean, std: warns on another target's
        "num_hidden_layers": student.config.num_hidden_layers,
        **(info or {}),
    }
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in own_state(student).items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    student.config.to_json_file(str(folder / "config.json"))
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(str(folder))
    (folder / "README.md").write_text(card)
    # the marker last: a folder is recognised as a draft only once everything else is in place
    (folder / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
    return folder


def read_marker(folder: str | Path) -> dict:
    marker = json.loads((Path(folder) / MARKER).read_text())
    if marker.get("format") != FORMAT:
        raise ValueError(
            f"{folder}: {MARKER} is not an agentspec draft marker (format {marker.get('format')!r})"
        )
    return marker


def load_draft(folder: str | Path, target):
    """Load a draft folder onto ``target``'s embeddings and LM head (its device and dtype).

    Raises ValueError when the target's embedding or LM-head shape is not the one the draft was
    distilled with; warns when the shapes agree but the embedding values look like another model's.
    """
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(folder).expanduser()
    marker = read_marker(folder)
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    for what, want, got in (
        ("embedding", marker["embedding_shape"], list(embed.shape)),
        ("LM head", marker["lm_head_shape"], list(head.shape)),
    ):
        if want != got:
            raise ValueError(
                f"{folder}: draft distilled for {marker['shares_embeddings_with']!r} with a {what} of shape "
                f"{want}; this target's is {got}. Load it with the target it was distilled from."
            )
    want_fp, got_fp = marker.get("embedding_fingerprint"), _fingerprint(embed)
    if want_fp and any(abs(a - b) > 0.02 * max(abs(a), 1e-3) for a, b in zip(want_fp, got_fp)):
        log.warning(
            "%s: the target's embeddings (mean, std %s) are not those the draft was distilled with (%s); "
            "the output stays the target's, but few drafts will be accepted",
            folder,
            got_fp,
            want_fp,
        )
    config = AutoConfig.from_pretrained(str(folder))
    draft = AutoModelForCausalLM.from_config(config)
    state = load_file(str(folder / "model.safetensors"))
    missing, unexpected = draft.load_state_dict(state, strict=False)
    shared = shared_keys(draft)
    if unexpected or set(missing) - shared:
        raise ValueError(f"{folder}: model.safetensors does not fit its config: {missing=} {unexpected=}")
    draft.to(device=embed.device, dtype=embed.dtype)
    attach_shared(draft, target)
    draft.config.name_or_path = str(folder)
    return draft.eval()
