"""LangChain's standard chat-model suites (langchain-tests, pinned in pyproject) on ChatSpecDecode.

The unit suite builds models without loading weights. The integration suite runs on the embedded
SmolLM2-135M-Instruct; every model it builds shares one loaded pair through ``pair=``. Overridden
tests carry ``xfail`` with the reason; each is a limit of the 135M model, not of the integration.
"""

from __future__ import annotations

import functools

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

import agentspec
from langchain_agentspec import ChatSpecDecode


@functools.cache
def shared_pair() -> agentspec.ModelPair:
    return agentspec.load_pair()


class TestChatSpecDecodeUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatSpecDecode]:
        return ChatSpecDecode

    @property
    def supports_model_override(self) -> bool:
        return False  # one instance serves one loaded model


# Tool calls and structured output pass because the reply is grammar-constrained (issue 5): a
# required call or a structured answer is valid by construction, with the model's own values.
# What no grammar can do without changing the model's distribution is make it *choose* to call
# when tool_choice is not set: unforced, SmolLM2-135M answers in prose.
WILL_NOT_CALL = "SmolLM2-135M answers in prose instead of calling the tool when the call is not forced"
# Nor can a grammar stop a greedy 135M model repeating itself inside a JSON string: the reply stays
# valid JSON up to max_tokens (40 here), where the string is cut and cannot parse.
LOOPS_IN_A_STRING = "SmolLM2-135M repeats a phrase inside a JSON string until max_tokens cuts it"


@pytest.mark.model
@pytest.mark.usefixtures("one_thread")  # see test_chat_model.py: two threads thrash on a busy machine
# pyproject's asyncio_mode is "strict": mark the suite's async tests (the sync ones ignore the mark)
@pytest.mark.asyncio
@pytest.mark.filterwarnings("ignore:.*is marked with '@pytest.mark.asyncio' but it is not an async")
class TestChatSpecDecodeIntegration(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatSpecDecode]:
        return ChatSpecDecode

    @property
    def chat_model_params(self) -> dict:
        # enough tokens to close a forced tool call; greedy, so every run is the same
        return {"pair": shared_pair(), "max_tokens": 40}

    @property
    def supports_model_override(self) -> bool:
        return False

    @property
    def supported_usage_metadata_details(self) -> dict:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        llm = ChatSpecDecode(pair=shared_pair(), max_tokens=4)
        messages = [SystemMessage("You are a helpful assistant. " * 20), HumanMessage("Hi")]
        llm.invoke(messages)  # the second call can restore this prompt from the prefix cache
        if not stream:
            return llm.invoke(messages)
        full = None
        for chunk in llm.stream(messages):
            full = chunk if full is None else full + chunk
        return full

    @pytest.mark.slow
    @pytest.mark.xfail(reason=WILL_NOT_CALL + " (tool_choice is not set in this test)")
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    def test_agent_loop(self, model) -> None:
        super().test_agent_loop(model)

    @pytest.mark.slow
    @pytest.mark.xfail(reason=LOOPS_IN_A_STRING + " (the Joke's setup: 'A cat is a cat, a cat is a...')")
    def test_structured_output_optional_param(self, model) -> None:
        super().test_structured_output_optional_param(model)

    @pytest.mark.slow
    @pytest.mark.xfail(reason=LOOPS_IN_A_STRING + " (a customer name with accents)")
    def test_unicode_tool_call_integration(self, model, **kwargs) -> None:
        super().test_unicode_tool_call_integration(model, **kwargs)
