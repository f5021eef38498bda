"""A plain prompt prepared as a ``ChatCall``: its ids decoded as they are, without a chat template, a
grammar or tool-call parsing, so a completion (the server's ``/v1/completions``) runs through the same
``run`` and ``reply_deltas`` as a chat reply, and its greedy text is ``agentspec.generate``'s over the
same ids.
"""

from __future__ import annotations

from agentspec.chat.prompt import Prompt
from agentspec.chat.request import ChatCall, PreparedRequest
from agentspec.config import GenerationConfig
from agentspec.decode import ContextLengthExceeded, check_prompt, context_room
from agentspec.models import ModelPair


def prepare_completion(pair: ModelPair, prompt: str | list[int], config: GenerationConfig) -> ChatCall:
    """``prompt`` (text, tokenised as the tokenizer does with its special tokens, or token ids) as a
    call on ``pair`` with ``config`` cut to the room it leaves in the context window.

    ``ContextLengthExceeded`` where it leaves none; a ValueError for an empty prompt or an id
    outside the model's vocabulary."""
    ids = list(pair.tokenizer(prompt)["input_ids"]) if isinstance(prompt, str) else list(prompt)
    if context_room(pair, len(ids)) < 1:
        raise ContextLengthExceeded(len(ids), pair.max_context, "prompt")
    ids = check_prompt(pair, ids)
    text = prompt if isinstance(prompt, str) else pair.tokenizer.decode(ids)
    plain = Prompt(text, ids, forced="", tool_format="hermes", native_tools=False)
    request = PreparedRequest(plain, grammar=None, tool_names=None, single=False, stop=())
    return ChatCall(pair, request, request.fitted(pair, config), grammar=None)
