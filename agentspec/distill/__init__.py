"""Distilling a draft model from the target itself (``agentspec distill``).

prompts.py   the built-in prompts (chat, instructions, tool calls, tool results, code, agent turns)
data.py      the target's responses and top-k log-probs, in resumable shards
student.py   the draft: target layers on the target's embeddings; save_draft (agentspec.draft_folder reads it)
train.py     the distillation loss, learning-rate schedule, batches, loop, checkpoints, evaluation
pipeline.py  distill(): all of it, under one time budget
"""

from agentspec.distill.config import DistillConfig
from agentspec.distill.pipeline import distill
from agentspec.distill.student import save_draft

__all__ = ["DistillConfig", "distill", "save_draft"]
