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
from integrations.langchain import ChatSpecDecode


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


# Tool calls and structured output need the model to fill in arguments. A required call is forced
# up to its first argument's name (see messages.forced_prefix), but the 135M model then copies the
# JSON schema from the prompt ({"input": {"type": "integer", ...}}) instead of writing a value, and
# unforced it answers in prose. Grammar-constrained decoding (the next issue) makes these pass.
# They are also marked slow: they spend model time on known failures, so only the full suite
# (`pytest` without -m "not slow") runs them, to notice when they start passing.
CANNOT_FILL_ARGUMENTS = (
    "SmolLM2-135M copies the tool's JSON schema instead of writing argument values, so the call is "
    "invalid or carries wrong arguments"
)
WILL_NOT_CALL = "SmolLM2-135M answers in prose instead of calling the tool when the call is not forced"


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
    @pytest.mark.xfail(reason=CANNOT_FILL_ARGUMENTS)
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    def test_tool_calling(self, model) -> None:
        super().test_tool_calling(model)

    @pytest.mark.slow
    @pytest.mark.xfail(reason=CANNOT_FILL_ARGUMENTS)
    async def test_tool_calling_async(self, model) -> None:
        await super().test_tool_calling_async(model)

    @pytest.mark.slow
    @pytest.mark.xfail(reason=CANNOT_FILL_ARGUMENTS + " (tool_choice='any' with two tools, prompt 'Hello!')")
    def test_tool_choice(self, model) -> None:
        super().test_tool_choice(model)

    @pytest.mark.slow
    @pytest.mark.xfail(reason=CANNOT_FILL_ARGUMENTS + " (the Joke schema's setup and punchline)")
    @pytest.mark.parametrize("schema_type", ["pydantic", "typeddict", "json_schema"])
    def test_structured_output(self, model, schema_type) -> None:
        super().test_structured_output(model, schema_type)

    @pytest.mark.slow
    @pytest.mark.xfail(reason=CANNOT_FILL_ARGUMENTS + " (the Joke schema's setup and punchline)")
    @pytest.mark.parametrize("schema_type", ["pydantic", "typeddict", "json_schema"])
    async def test_structured_output_async(self, model, schema_type) -> None:
        await super().test_structured_output_async(model, schema_type)

    @pytest.mark.slow
    @pytest.mark.xfail(reason=CANNOT_FILL_ARGUMENTS + " (the Joke schema's setup and punchline)")
    def test_structured_output_pydantic_2_v1(self, model) -> None:
        super().test_structured_output_pydantic_2_v1(model)

    @pytest.mark.slow
    @pytest.mark.xfail(reason=CANNOT_FILL_ARGUMENTS + " (the Joke schema's setup and punchline)")
    def test_structured_output_optional_param(self, model) -> None:
        super().test_structured_output_optional_param(model)

    @pytest.mark.slow
    @pytest.mark.xfail(reason=WILL_NOT_CALL + " (tool_choice is not set in this test)")
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    def test_agent_loop(self, model) -> None:
        super().test_agent_loop(model)

    @pytest.mark.slow
    @pytest.mark.xfail(reason=CANNOT_FILL_ARGUMENTS + " (customer_name comes back as {'type': 'string'})")
    def test_unicode_tool_call_integration(self, model, **kwargs) -> None:
        super().test_unicode_tool_call_integration(model, **kwargs)
