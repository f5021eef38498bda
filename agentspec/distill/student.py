"""The draft: a few decoder layers of the target's own architecture, on the target's embeddings.

The draft is a standard transformers causal LM built from the target's config with fewer layers,
each initialised from a chosen target layer (``init_layers``), its final norm from the target's.
Its input embeddings and LM head *are* the target's modules (shared, frozen): for SmolLM2-135M they
are 28M of the draft's 35M parameters, so a draft folder stores only its own layers and norm
(safetensors) and is completed from the target when loaded.

A draft folder:
    agentspec_draft.json   the marker: what the draft shares with which target, and its shapes
    config.json            the draft's transformers config (num_hidden_layers = the draft's)
    model.safetensors      the draft's own tensors (float16), without embeddings and LM head, and
                           ``draft_vocab``: the token ids its LM head scores (see SubsetHead)
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

from agentspec.drafters.eagle import EAGLE_ARCHITECTURE, is_eagle

log = logging.getLogger(__name__)

MARKER = "agentspec_draft.json"
FORMAT = "agentspec-distilled-draft"
VOCAB_KEY = "draft_vocab"  # model.safetensors entry: the ids the draft's LM head scores
# Filled into the logits of tokens outside the draft's vocabulary: finite, so a grammar mask that
# leaves only such tokens still gives a distribution (uniform over them), and within float16 range.
OUTSIDE_LOGIT = -1.0e4


class SubsetHead(torch.nn.Module):
    """The LM head cut to the ids the draft proposes (FR-Spec, Zhao et al. 2025).

    The head dominates a small draft's step: for SmolLM2-135M, 576 x 49,152 multiply-adds against
    about 4M for one decoder layer. Scoring only ``ids`` (the tokens most frequent in the target's
    own responses) makes the step several times cheaper. The output keeps the full vocabulary, with
    ``OUTSIDE_LOGIT`` elsewhere, so the draft's q is an ordinary distribution the verification
    treats like any other; the target's output does not depend on it (lossless either way), only
    how often a draft is accepted.
    """

    def __init__(self, weight: torch.Tensor, ids: torch.Tensor):
        super().__init__()
        self.vocab_size = int(weight.shape[0])
        self.register_buffer("ids", ids.to(device=weight.device, dtype=torch.long), persistent=False)
        self.register_buffer("weight", weight.detach()[self.ids].contiguous(), persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        sub = torch.nn.functional.linear(hidden, self.weight.to(hidden.dtype))
        out = sub.new_full((*sub.shape[:-1], self.vocab_size), OUTSIDE_LOGIT)
        return out.index_copy_(-1, self.ids, sub)


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
        "embedding_fingerprint": _fingerprint(embed),  # mean, std: warns on another target's
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
    eagle = marker.get("architecture") == EAGLE_ARCHITECTURE
    if eagle:
        from agentspec.drafters.eagle import EagleHead

        draft = EagleHead(config, target.get_input_embeddings(), target.get_output_embeddings())
    else:
        draft = AutoModelForCausalLM.from_config(config)
    state = load_file(str(folder / "model.safetensors"))
    vocab = state.pop(VOCAB_KEY, None)
    missing, unexpected = draft.load_state_dict(state, strict=False)
    shared = set() if eagle else shared_keys(draft)
    if unexpected or set(missing) - shared:
        raise ValueError(f"{folder}: model.safetensors does not fit its config: {missing=} {unexpected=}")
    draft.to(device=embed.device, dtype=embed.dtype)
    if not eagle:
        attach_shared(draft, target)
    if vocab is not None and 0 < vocab.numel() < head.shape[0]:
        if int(vocab.min()) < 0 or int(vocab.max()) >= head.shape[0]:
            raise ValueError(f"{folder}: {VOCAB_KEY} has ids outside [0, {head.shape[0]})")
        # the draft's own head module; the target's stays as it is (and still feeds the embeddings)
        draft.set_output_embeddings(SubsetHead(head, vocab))
    draft.config.name_or_path = str(folder)
    return draft.eval()
