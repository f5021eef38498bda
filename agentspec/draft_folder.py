"""Reading a draft folder, the format ``agentspec distill`` writes (``distill.student.save_draft``).

A distilled draft is a few decoder layers of the target's own architecture (or an EAGLE head) on
the target's embeddings: its input embeddings and LM head *are* the target's modules (shared,
frozen), so the folder stores only the draft's own layers and norm and is completed from the
target when loaded. Loading a pair reads it; nothing here imports the trainer.

A draft folder:
    agentspec_draft.json   the marker: what the draft shares with which target, and its shapes
    config.json            the draft's transformers config (num_hidden_layers = the draft's)
    model.safetensors      the draft's own tensors (float16), without embeddings and LM head, and
                           ``draft_vocab``: the token ids its LM head scores (see SubsetHead)
    tokenizer files        the target's, so the pair's tokenizer check applies as for any draft
    README.md              the model card
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from agentspec.drafters.eagle import EAGLE_ARCHITECTURE, vocab_logits

log = logging.getLogger(__name__)

MARKER = "agentspec_draft.json"
FORMAT = "agentspec-distilled-draft"
VOCAB_KEY = "draft_vocab"  # model.safetensors entry: the ids the draft's LM head scores


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
        return vocab_logits(sub, self.ids, self.vocab_size)


def is_draft_folder(source: Any) -> bool:
    """Is ``source`` a folder written by ``save_draft``?"""
    if not isinstance(source, (str, Path)):
        return False
    return (Path(source).expanduser() / MARKER).is_file()


def read_marker(folder: str | Path) -> dict:
    marker = json.loads((Path(folder) / MARKER).read_text())
    if marker.get("format") != FORMAT:
        raise ValueError(
            f"{folder}: {MARKER} is not an agentspec draft marker (format {marker.get('format')!r})"
        )
    return marker


def fingerprint(weight: torch.Tensor) -> list[float]:
    """(mean, std) of an embedding: the marker keeps it to warn when a draft meets another target."""
    w = weight.detach().double()
    return [float(w.mean()), float(w.std())]


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


def _check_target(folder: Path, marker: dict, embed: torch.Tensor, head: torch.Tensor) -> None:
    """ValueError when the target's shapes are not the draft's; a warning when only its values differ."""
    for what, want, got in (
        ("embedding", marker["embedding_shape"], list(embed.shape)),
        ("LM head", marker["lm_head_shape"], list(head.shape)),
    ):
        if want != got:
            raise ValueError(
                f"{folder}: draft distilled for {marker['shares_embeddings_with']!r} with a {what} of shape "
                f"{want}; this target's is {got}. Load it with the target it was distilled from."
            )
    want_fp, got_fp = marker.get("embedding_fingerprint"), fingerprint(embed)
    if want_fp and any(abs(a - b) > 0.02 * max(abs(a), 1e-3) for a, b in zip(want_fp, got_fp)):
        log.warning(
            "%s: the target's embeddings (mean, std %s) are not those the draft was distilled with (%s); "
            "the output stays the target's, but few drafts will be accepted",
            folder,
            got_fp,
            want_fp,
        )


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
    _check_target(folder, marker, embed, head)
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
