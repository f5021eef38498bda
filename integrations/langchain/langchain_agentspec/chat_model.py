"""``ChatSpecDecode``: a LangChain chat model over agentspec's decoding loop.

One path: ``_stream`` prepares the request with ``agentspec.chat.prepare_call`` (the messages
converted to the OpenAI format), decodes it with ``agentspec.chat.run`` (the server's two calls too)
and turns its deltas into chunks (the engine is imported
there, on the first local call, through ``_engine``: building the model and binding tools need no
torch); ``_generate`` only aggregates ``_stream`` (so tool calls, usage and metadata are the same
on both), and ``_astream`` runs ``_stream`` on one worker thread (the pair's lock must be released
by the thread that took it, which LangChain's default per-chunk executor hop does not guarantee).
With ``base_url`` set, the four entry points go to ``remote`` instead (an OpenAI-compatible
endpoint, through the openai client) and the chunks have the same shape.

Chunks: text as soon as the verified tokens make it safe to show (never tool-call markup: text is
held back while a ``<tool_call>`` may be starting); each tool call as one indexed
``tool_call_chunk`` once its block closes; a last chunk with ``chunk_position="last"`` carrying
``usage_metadata`` (``input_token_details.cache_read`` = prompt tokens restored from the prefix
cache) and ``response_metadata``: ``id`` (the reply's ``chatcmpl-`` id, which its span carries as
``gen_ai.response.id``), ``model_name``, ``finish_reason`` and ``speculative`` (drafter,
draft and accepted tokens, verify steps, acceptance rate, mean acceptance length counting the bonus
token, acceptance histogram by accepted count), ``latency`` (the time inside the decoder, the
plain-decoding estimate and the latency saved: the call's record, as its span reports it), plus
``stats``, the full ``DecodeStats`` record, and ``tool_call_errors`` ({id: why}) when a call was
invalid: LangChain rebuilds a streamed message's invalid tool calls from its chunks and leaves their
``error`` empty.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import functools
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput, ModelProfile
from langchain_core.language_models.chat_models import LangSmithParams, generate_from_stream
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, UsageMetadata
from langchain_core.messages.tool import tool_call_chunk
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils import secret_from_env
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from pydantic import ConfigDict, Field, PrivateAttr, SecretStr, field_validator, model_validator

from langchain_agentspec import _engine
from langchain_agentspec._run import late_parent, run_conversation_id, tracer_reports_usage
from langchain_agentspec.messages import to_openai_messages
from langchain_agentspec.remote_span import PROVIDER
from langchain_agentspec.structured import openai_response_format, structured_parser

ToolLike = dict[str, Any] | type | Callable | BaseTool  # what bind_tools takes, as LangChain's models do

if TYPE_CHECKING:  # the engine is imported on first local use, through _engine
    from agentspec import GenerationConfig, ModelPair
    from agentspec.chat import ChatCall
    from agentspec.decode import CallRecord
    from agentspec.stats import DecodeStats
    from agentspec.telemetry import Telemetry
    from langchain_agentspec.remote import Remote

# Arguments LangChain's standard tests and callers pass to any chat model; meaningless here, so they
# are accepted and dropped. Any other unknown argument is an error (a typo would otherwise silently
# load the default model).
_IGNORED_INIT_ARGS = {"streaming", "callback_manager"}
# What only a local pair has: set with base_url, they are an error (the server chose them)
_LOCAL_ONLY = (
    "draft_model", "drafter", "max_draft_tokens", "device", "dtype", "speculative", "prefix_cache",
    "constrained", "jump_forward", "pair",
)  # fmt: skip
# Per-call arguments LangChain itself may add; dropped.
_IGNORED_CALL_ARGS = {"stream", "ls_structured_output_format", "structured_output_format"}
_CALL_OVERRIDES = {
    "temperature", "top_p", "top_k", "max_tokens", "seed", "speculative", "max_draft_tokens",
    "drafter", "prefix_cache", "constrained", "jump_forward", "timeout", "logprobs", "top_logprobs",
}  # fmt: skip


def _logprobs(logprobs: bool | None, top: int | None) -> int | None:
    """``GenerationConfig.logprobs`` from OpenAI's pair of options (None: none asked for)."""
    if top and not logprobs:
        raise ValueError("top_logprobs needs logprobs=True, as in OpenAI's API")
    return (top or 0) if logprobs else None


# Pairs loaded by ChatSpecDecode instances, keyed by what was asked for: instances with the same
# model, draft model, device and dtype share one set of weights (and one prefix cache).
_PAIRS: weakref.WeakValueDictionary[tuple, ModelPair] = weakref.WeakValueDictionary()
_PAIRS_LOCK = threading.Lock()
_TELEMETRY_LOCK = threading.Lock()  # guards each instance's first ``_tracing()``


def shared_pair(model: str | None, draft_model: str | None, device: str | None, dtype: str | None):
    """``load_pair`` once per distinct request in this process; later calls get the same pair."""
    key = (model, draft_model, device, dtype)
    with _PAIRS_LOCK:
        pair = _PAIRS.get(key)
        if pair is None:
            pair = _engine.engine().load_pair(model, draft_model, device=device, dtype=dtype)
            _PAIRS[key] = pair
        return pair


def _chunk_of_call(call: dict, index: int) -> dict:
    """A whole ``agentspec.chat`` call as one indexed tool_call_chunk (an invalid one's arguments
    are the model's raw text)."""
    function = call["function"]
    return tool_call_chunk(name=function["name"], args=function["arguments"], id=call["id"], index=index)


@dataclasses.dataclass
class _Prepared:
    """One request, prepared: what ``_stream`` runs."""

    chat: ChatCall  # the pair, the prepared request, its fitted config and compiled grammar
    prefix_cache: Any  # agentspec.stream's prefix_cache: True, False or a PrefixCache
    drafter: Any


class ChatSpecDecode(BaseChatModel):
    """Local chat model with lossless speculative decoding and prefix KV reuse, for agents.

    Greedy output (``temperature=0``, the default) is token for token what the target model alone
    would write; sampled output has the same distribution. Weights load on first use, so building
    the object is cheap; pass ``pair=`` to share one loaded pair (weights and prefix cache) between
    several instances.

    ```python
    from langchain_agentspec import ChatSpecDecode

    llm = ChatSpecDecode()  # the embedded SmolLM2-135M-Instruct and its EAGLE draft
    llm.invoke("What is the capital of France?")
    llm.bind_tools([get_weather], tool_choice="any").invoke("Weather in Paris?").tool_calls

    # the same model over HTTP (`agentspec serve`, `vllm serve`, a router): no torch needed here
    remote = ChatSpecDecode(base_url="http://127.0.0.1:8000/v1", api_key="...")
    ```
    """

    model: str | None = None
    """Target model: a Hugging Face hub id, a local folder or a ``.gguf`` file. None: the embedded
    default, SmolLM2-135M-Instruct."""

    draft_model: str | Literal[False] | None = None
    """A smaller model with the same tokenizer that proposes tokens for the target to verify, or a
    folder written by ``agentspec distill``. None: the embedded default draft with the embedded
    target, no draft model with any other target. False: no draft model (the drafters then work
    from the conversation alone: suffix trees and n-gram lookup)."""

    drafter: Any = "auto"
    """Who proposes draft tokens: "auto" (per pass, a suffix-tree draft over this conversation and
    earlier replies, or the confidence-scheduled draft model, whichever is worth more), "suffix",
    "model", "model_scheduled", "prompt_lookup", "none", or an ``agentspec.Drafter`` instance."""

    max_draft_tokens: int | None = None
    """The most draft tokens verified per target forward pass (None: the drafter's own cap)."""

    temperature: float = 0.0
    """0 = greedy (deterministic); above 0 samples from softmax(logits / temperature)."""

    top_p: float | None = None
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""

    top_k: int | None = None
    """Keep only the k most likely tokens before sampling."""

    max_tokens: int | None = 512
    """The most tokens generated per call (finish_reason "length"). None: up to the context window."""

    stop: list[str] | None = None
    """Stop strings: the reply ends right before the first one."""

    seed: int | None = None
    """Seed for sampling: the same seed gives the same output (``GenerationConfig.reproducible``: each
    position's draw is keyed by the seed, whatever was drafted or cached), as over HTTP."""

    logprobs: bool | None = None
    """True: each reply token's log-probability under the target (before temperature, top-p and
    grammar masks) in ``response_metadata["logprobs"]["content"]``, as ChatOpenAI puts them."""

    top_logprobs: int | None = None
    """With ``logprobs``: this many most likely tokens (0-20) at each position besides."""

    streaming: bool = False
    """Whether ``invoke`` (and ``generate``) decode through ``_stream``, calling back
    ``on_llm_new_token`` with each chunk as the target verifies it, as ``ChatOpenAI(streaming=True)``
    does. The reply is the same either way; ``stream`` always streams."""

    timeout: float | None = None
    """Seconds a call may take, the wait for the model included (another call may hold it); None:
    no limit. Past it the call raises ``agentspec.DecodeTimeout`` (a ``TimeoutError``) and the model,
    its lock and its prefix cache are ready for the next call. Checked between decoding passes."""

    device: str | None = None
    """Where the model runs ("cpu", "cuda", "cuda:1"). None: CUDA if available, else CPU."""

    dtype: str | None = None
    """Weights dtype ("float32", "bfloat16", "auto"). None: ``agentspec.models.default_dtype``
    ($AGENTSPEC_DTYPE, else bfloat16 on CUDA, float32 on CPU)."""

    speculative: bool = True
    """False: the same decoding loop without any draft (the honest baseline)."""

    prefix_cache: bool | int = True
    """Reuse the KV state of earlier calls' common prompt prefix. True: the pair's cache, shared
    by every instance on that pair; False: recompute every prompt; an int: a cache of this many
    bytes owned by this instance."""

    constrained: bool = True
    """Constrain tool calls and structured output with a grammar, so that every call names a bound
    tool with arguments valid under its schema, and every structured reply parses and validates.
    False: the model writes freely and its output is only parsed."""

    jump_forward: bool | None = None
    """Under a grammar, append tokens it forces without a model guess and propose the text it forces
    as draft tokens. None: on when ``speculative`` is (the plain baseline has neither)."""

    pair: Any = Field(default=None, exclude=True, repr=False)
    """An already loaded ``agentspec.ModelPair`` (``agentspec.load_pair(...)``); replaces model,
    draft_model, device, dtype."""

    tracer_provider: Any = Field(default=None, exclude=True, repr=False)
    """OpenTelemetry TracerProvider for a ``chat {model}`` span per call (``agentspec.telemetry``).
    None: the global one; with no SDK configured, nothing is recorded."""

    meter_provider: Any = Field(default=None, exclude=True, repr=False)
    """OpenTelemetry MeterProvider for the calls' metrics. None: the global one. (Remote calls record
    no metrics: the server counts them.)"""

    span_usage: bool | None = None
    """Whether the ``chat {model}`` span carries ``gen_ai.usage.*``. None: unless a LangChain tracer
    (OpenInference, OpenLLMetry, LangSmith's OpenTelemetry export) traces the call, whose LLM span
    reports the same tokens, so that a backend adding up a trace's spans counts them once; True:
    always; False: never. The metrics count usage either way. The same for a remote call's CLIENT
    span."""

    base_url: str | None = None
    """An OpenAI-compatible endpoint (``agentspec serve``, ``vllm serve``, a router) as the openai
    client takes it, ``http://host:port/v1``: calls go there (``langchain_agentspec.remote``, the
    ``[remote]`` extra) and nothing loads here, no weights and no torch; ``model`` is the name sent
    (None: the endpoint's first in ``/v1/models``), ``timeout`` the deadline of a request and its
    retries (each attempt's own timeout is what is left of it; past it the openai client's
    ``APITimeoutError``). None: the local pair."""

    api_key: SecretStr | None = Field(default_factory=secret_from_env("AGENTSPEC_API_KEY", default=None))
    """The endpoint's key (``Authorization: Bearer``); default ``AGENTSPEC_API_KEY`` from the
    environment. Unused by a local pair."""

    max_retries: int = Field(default=2, ge=0)
    """Remote calls: retries on connection errors, 502/503/504 and a router's failure to reach its
    worker, within ``timeout``; a stream only before its first chunk. Unused by a local pair."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    _loaded: ModelPair | None = PrivateAttr(default=None)
    _own_cache: Any = PrivateAttr(default=None)  # the PrefixCache of a prefix_cache=<bytes> instance
    _telemetry: Telemetry | None = PrivateAttr(default=None)  # built by _tracing() on the first call
    _remote: Remote | None = PrivateAttr(default=None)  # the openai clients, built with a base_url
    _tokenizer: Any = PrivateAttr(default=None)  # the target's, to count tokens before a pair is loaded

    @model_validator(mode="before")
    @classmethod
    def _check_arguments(cls, values: Any) -> Any:
        if not isinstance(values, dict):
            return values
        known = set(cls.model_fields)
        unknown = set(values) - known - _IGNORED_INIT_ARGS
        if unknown:
            raise ValueError(f"ChatSpecDecode: unknown arguments {sorted(unknown)}")
        return {k: v for k, v in values.items() if k in known}

    @field_validator("pair")
    @classmethod
    def _check_pair(cls, pair: Any) -> Any:
        # a pair is the engine's: passing one imports it (the install hint where it is missing)
        if pair is not None and not isinstance(pair, _engine.engine().ModelPair):
            raise ValueError(f"pair: expected an agentspec.ModelPair, got {type(pair).__name__}")
        return pair

    @model_validator(mode="after")
    def _check(self) -> ChatSpecDecode:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 or None, got {self.max_tokens}")
        if self.base_url is not None:
            return self._check_remote()
        if self.pair is not None:
            given = {"draft_model": self.draft_model, "device": self.device, "dtype": self.dtype}
            clash = [n for n, v in given.items() if v is not None]
            if self.model is not None and self.model != self.pair.name:
                clash.insert(0, "model")
            if clash:
                raise ValueError(f"pass either pair= or {clash}, not both: the pair is already loaded")
        budget = self.prefix_cache
        if isinstance(budget, int) and not isinstance(budget, bool) and budget <= 0:
            raise ValueError(f"prefix_cache: a byte budget must be > 0, got {self.prefix_cache}")
        if _engine.installed():  # else the first local call checks these, with the same code
            self._check_with_engine()
        return self

    def _check_remote(self) -> ChatSpecDecode:
        """A remote instance: no local-only settings; its openai clients (the extra's hint where
        openai is missing)."""
        local = [name for name in _LOCAL_ONLY if name in self.model_fields_set]
        if local:
            raise ValueError(f"base_url: {local} are the server's settings, not this client's")
        from langchain_agentspec.remote import Remote

        key = self.api_key.get_secret_value() if self.api_key is not None else None
        self._remote = Remote(
            self.base_url, key, self.timeout, self.max_retries, self.tracer_provider, self.span_usage
        )
        return self

    def _checks_locally(self) -> bool:
        """Whether tools, formats and settings are checked here, by the engine's code (a remote
        instance leaves them to its server)."""
        return self.base_url is None and _engine.installed()

    def _check_with_engine(self) -> None:
        """The settings only the engine's code knows how to check: the drafter, the sampling ones."""
        agentspec = _engine.engine()
        names, d = _engine.drafter_names(), self.drafter
        if not (d in names or isinstance(d, agentspec.Drafter)):
            raise ValueError(f"drafter: expected one of {names} or a Drafter, got {d!r}")
        self._generation_config({})  # checks temperature, top_p, top_k, seed, stop

    # -- identity ------------------------------------------------------------------------------

    @property
    def _llm_type(self) -> str:
        return "agentspec"

    @property
    def model_name(self) -> str:
        """Name of the target model (the loaded pair's, when there is one; the engine names its
        embedded default)."""
        if self.pair is not None:
            return self.pair.name
        if self._remote is not None:
            return self.model or self._remote.served_model()
        return self.model or _engine.default_model_name()

    @property
    def _identifying_params(self) -> dict[str, Any]:
        drafter = self.drafter if isinstance(self.drafter, str) else self.drafter.name
        return {
            "model": self.model_name,
            "base_url": self.base_url,
            "draft_model": self.pair.draft_name if self.pair is not None else self.draft_model,
            "drafter": drafter,
            "max_draft_tokens": self.max_draft_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_tokens": self.max_tokens,
            "stop": self.stop,
            "seed": self.seed,
            "speculative": self.speculative,
            "prefix_cache": self.prefix_cache,
            "constrained": self.constrained,
            "jump_forward": self.jump_forward,
        }

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider=PROVIDER,
            ls_model_name=kwargs.get("model") or self.model_name,
            ls_model_type="chat",
            ls_temperature=kwargs.get("temperature", self.temperature),
        )
        max_tokens = kwargs.get("max_tokens", self.max_tokens)
        if max_tokens is not None:
            params["ls_max_tokens"] = max_tokens
        if stop := stop or self.stop:
            params["ls_stop"] = list(stop)
        return params

    # -- loading ---------------------------------------------------------------------------------

    def load(self) -> ModelPair:
        """The model pair, loaded now if it was not yet (shared with same-configured instances)."""
        if self.pair is not None:
            return self.pair
        if self._loaded is None:
            self._loaded = shared_pair(self.model, self.draft_model, self.device, self.dtype)
        return self._loaded

    # -- counting tokens -------------------------------------------------------------------------

    def get_token_ids(self, text: str) -> list[int]:
        """The target's token ids of ``text`` (no special tokens added): its own tokenizer, loaded
        without the weights until the pair is; a remote endpoint's ``/tokenize`` (agentspec serve,
        vLLM). ``custom_get_token_ids`` comes first where set."""
        if self.custom_get_token_ids is not None:
            return self.custom_get_token_ids(text)
        if self.base_url is not None:
            return self._remote.token_ids(self.model_name, text)
        return list(self._target_tokenizer()(text, add_special_tokens=False)["input_ids"])

    def get_num_tokens_from_messages(
        self, messages: list[BaseMessage], tools: Sequence[ToolLike] | None = None
    ) -> int:
        """The tokens of the prompt ``messages`` (and ``tools``) make, rendered as a call renders them
        (the chat template, tools in it or in the Hermes fallback, the generation prompt): the
        ``usage_metadata["input_tokens"]`` a call with them reports. Remote: the endpoint's count."""
        converted = [convert_to_openai_tool(t) for t in tools or ()]
        openai_messages = to_openai_messages(messages)
        if self.base_url is not None:
            return self._remote.count_tokens(self.model_name, openai_messages, converted)
        render = _engine.engine().chat.prompt.render
        return len(render(self._target_tokenizer(), openai_messages, converted).ids)

    def _target_tokenizer(self) -> Any:
        if self.pair is not None or self._loaded is not None:
            return self.load().tokenizer
        if self._tokenizer is None:
            self._tokenizer = _engine.engine().models.load_tokenizer(self.model)
        return self._tokenizer

    # -- tools -----------------------------------------------------------------------------------

    def bind_tools(
        self,
        tools: Sequence[ToolLike],
        *,
        tool_choice: str | dict | bool | None = None,
        strict: bool | None = None,
        parallel_tool_calls: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (LangChain tools, functions, pydantic models, TypedDicts or JSON schemas).

        ``tool_choice``: None or "auto" (the model decides), "none" (no calls: generation stops at
        a ``<tool_call>`` tag), "any" or "required" (at least one call), or a tool's name (that
        tool). A required call is forced by writing the start of the call into the reply. A named
        tool (or "any" with a single tool bound) gives exactly one call, and decoding stops as soon
        as it is complete; ``parallel_tool_calls=False`` does the same for any reply.
        """
        formatted = [convert_to_openai_tool(t, strict=strict) for t in tools]
        if parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = parallel_tool_calls
        if (
            self._checks_locally()
        ):  # else agentspec.chat.prepare (or the server) checks them at the first call
            formatted, tool_choice = self._checked_tools(formatted, tool_choice, kwargs)
        return super().bind(tools=formatted, tool_choice=tool_choice, **kwargs)

    def _checked_tools(self, tools: list[dict], tool_choice: Any, kwargs: dict) -> tuple[list[dict], Any]:
        """Tools and ``tool_choice`` as ``agentspec.chat`` normalises them; a schema the grammar
        engine refuses fails here, at binding."""
        request = _engine.engine().chat.request
        tools = request.checked_tools(tools)
        choice = request.normalise_tool_choice(tool_choice, [t["function"]["name"] for t in tools])
        answer = request.response_schema(openai_response_format(kwargs.get("response_format")))
        if kwargs.get("constrained", self.constrained):
            request.output_grammar(tools if choice != "none" else [], choice, answer, "hermes", single=False)
        return tools, choice

    def with_structured_output(
        self,
        schema: dict | type,
        *,
        method: str = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict | Any]:
        """A runnable whose output is ``schema``'s type: a pydantic instance, else a dict.

        ``method``: "json_schema" (the default: the whole reply is JSON constrained to the schema),
        "function_calling" (a call to a tool named after the schema, its arguments constrained), or
        "json_mode" (a JSON object; constrained to the schema when one is given, since the result
        is parsed with it anyway). With ``constrained=True`` (the default) the result always parses
        and validates, unless the reply is cut by ``max_tokens``. ``include_raw``: return
        ``{"raw": AIMessage, "parsed": ..., "parsing_error": ...}`` instead of raising.
        """
        if kwargs:
            raise ValueError(f"with_structured_output: unexpected arguments {sorted(kwargs)}")
        if method == "function_calling":
            return super().with_structured_output(schema, include_raw=include_raw)
        if method not in ("json_schema", "json_mode"):
            raise ValueError(
                f"method: expected 'json_schema', 'function_calling' or 'json_mode', got {method!r}"
            )
        parser = structured_parser(dict if schema is None else schema)
        llm = self.bind(
            response_format=self._response_format(schema, method),
            ls_structured_output_format={
                "kwargs": {"method": method},
                "schema": convert_to_json_schema(schema) if schema is not None else {"type": "object"},
            },
        )
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(
            parsed=lambda x: parser.invoke(x["raw"]), parsing_error=lambda _: None
        )
        failed = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([failed], exception_key="parsing_error")

    def _response_format(self, schema: dict | type | None, method: str) -> dict:
        """The ``response_format`` ``with_structured_output`` binds for ``schema``; with ``constrained``,
        a schema the grammar engine refuses fails here. Without the engine, a dict is bound as it
        is: ``agentspec.chat`` reads each of its forms at the first local call, and checks it there."""
        if schema is None and method == "json_mode":
            json_schema = {"type": "object"}
        elif not isinstance(schema, dict):
            json_schema = convert_to_json_schema(schema)
        elif self._checks_locally():
            request = _engine.engine().chat.request
            json_schema = request.response_schema(schema) or convert_to_json_schema(schema)
        else:
            return schema
        if self.constrained and self._checks_locally():
            _engine.engine().chat.request.output_grammar([], None, json_schema, "hermes", single=False)
        name = json_schema.get("title", "response") if isinstance(json_schema, dict) else "response"
        return {"type": "json_schema", "json_schema": {"name": name, "schema": json_schema}}

    def _resolve_model_profile(self) -> ModelProfile:
        # tools and tool_choice work, and structured output is constrained by a grammar: tells
        # create_agent to bind response_format (its provider strategy) rather than an extra tool
        profile = ModelProfile(
            open_weights=True,  # a local model: its weights are on this machine
            text_inputs=True,
            text_outputs=True,
            tool_calling=True,
            tool_choice=True,
            tool_call_streaming=True,  # each call streams as one whole, indexed tool_call_chunk
            structured_output=True,
            temperature=True,
        )
        if self.base_url is not None:  # what the server's model is, it does not say here
            return ModelProfile(**{k: v for k, v in profile.items() if k != "open_weights"})
        if self.pair is None and not _engine.installed():
            return profile  # the engine names the default model and reads model configs
        return profile | ModelProfile(name=self.model_name) | self._token_limits()

    def _token_limits(self) -> ModelProfile:
        """``max_input_tokens`` (the longest prompt a call takes: one token is left for the reply) and
        ``max_output_tokens`` (what ``max_tokens`` allows there), from the pair, or else the target's
        config without its weights; none where that cannot be read (a hub id offline, a typo: the
        first call says why)."""
        if self.pair is not None:
            context = self.pair.max_context
        else:
            try:
                context = _engine.read_max_context(self.model)
            except (OSError, ValueError):
                return ModelProfile()
        longest = context - 1
        cap = longest if self.max_tokens is None else min(self.max_tokens, longest)
        return ModelProfile(max_input_tokens=longest, max_output_tokens=cap)

    # -- one request -----------------------------------------------------------------------------

    def _generation_config(self, overrides: dict[str, Any]) -> GenerationConfig:
        get = overrides.get
        max_tokens = get("max_tokens", self.max_tokens)
        speculative = get("speculative", self.speculative)
        jump_forward = get("jump_forward", self.jump_forward)
        return _engine.engine().GenerationConfig(
            max_new_tokens=max_tokens if max_tokens is not None else 1 << 30,
            temperature=get("temperature", self.temperature),
            top_k=get("top_k", self.top_k),
            top_p=get("top_p", self.top_p),
            stop=tuple(get("stop", self.stop) or ()),
            seed=get("seed", self.seed),
            # a seeded reply is a function of the seed and the messages (as the server's): the same
            # whatever the drafters learned from earlier calls or the cache holds by then
            reproducible=get("seed", self.seed) is not None,
            num_draft_tokens=get("max_draft_tokens", self.max_draft_tokens),
            speculative=speculative,
            jump_forward=speculative if jump_forward is None else jump_forward,
            timeout=get("timeout", self.timeout),
            logprobs=(get("top_logprobs", self.top_logprobs) or 0)
            if get("logprobs", self.logprobs)
            else None,
        )

    def _prefix_cache(self, setting: bool | int) -> Any:
        """What ``agentspec.stream`` takes: True (the pair's shared cache), False, or a PrefixCache.

        A byte budget gives this instance a cache of its own of that size (created on first use).
        """
        if isinstance(setting, bool):
            return setting
        if self._own_cache is None or self._own_cache.budget_bytes != setting:
            self._own_cache = _engine.engine().cache.PrefixCache(setting)
        return self._own_cache

    def _prefill(self, messages: list[BaseMessage], tools: list[dict], tool_choice: str | None) -> str | None:
        """Text the reply is forced to start with; None: what ``tool_choice`` demands.

        A hook for subclasses (scripted tests, constrained starts); the default defers to
        ``agentspec.chat.prompt.forced_prefix``.
        """
        return None

    def _prepare(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict) -> _Prepared:
        kwargs = {k: v for k, v in kwargs.items() if k not in _IGNORED_CALL_ARGS}
        model = kwargs.pop("model", None)
        if model is not None and model != self.model_name:
            raise ValueError(
                f"model={model!r}: this ChatSpecDecode serves {self.model_name!r}; build another "
                "instance for another model (weights are shared between same-model instances)"
            )
        tools = kwargs.pop("tools", None) or []
        tool_choice = kwargs.pop("tool_choice", None)
        parallel = kwargs.pop("parallel_tool_calls", None) is not False
        response_format = openai_response_format(kwargs.pop("response_format", None))
        constrained = kwargs.pop("constrained", self.constrained)
        unknown = set(kwargs) - _CALL_OVERRIDES
        if unknown:
            raise TypeError(f"ChatSpecDecode: unexpected call arguments {sorted(unknown)}")
        overrides = dict(kwargs)
        if stop is not None:
            overrides["stop"] = stop
        chat = _engine.engine().chat
        call = chat.prepare_call(  # rendered, fitted to the context, its grammar compiled
            self.load(),
            to_openai_messages(messages),
            self._generation_config(overrides),
            tools,
            tool_choice,
            response_format,
            parallel_tool_calls=parallel,
            constrained=constrained,
            prefill=self._prefill(messages, tools, tool_choice),
        )
        prefix_cache = self._prefix_cache(overrides.get("prefix_cache", self.prefix_cache))
        return _Prepared(call, prefix_cache, overrides.get("drafter", self.drafter))

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        if self._remote is not None:
            yield from self._remote.stream(self._remote_options(messages, stop, kwargs), run_manager)
            return
        yield from self._replies(messages, stop, run_manager, kwargs, streamed=True)

    def _replies(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None,
        run_manager: CallbackManagerForLLMRun | None,
        kwargs: dict[str, Any],
        streamed: bool,
        cancelled: threading.Event | None = None,
    ) -> Iterator[ChatGenerationChunk]:
        """The chunks of one request (``streamed``: the caller streams; False when ``_generate``
        aggregates them, which the span records as ``gen_ai.request.stream``); once ``cancelled`` is
        set, the decoding takes no further pass and the chunks end."""
        agentspec = _engine.engine()  # the first local call imports it (or says how to install it)
        try:
            prepared = self._prepare(messages, stop, kwargs)
        except Exception as exc:
            self._trace(None, run_manager, streamed, exc)
            raise
        errors: dict[str, str] = {}  # invalid call id -> why (chunk merging drops the error field)
        response_id = agentspec.chat.new_response_id()  # the span's gen_ai.response.id, and the reply's
        # a span and metrics (no-ops without an OpenTelemetry SDK), told the reply as parsed at the end
        trace = self._trace(prepared, run_manager, streamed, response_id=response_id)
        texts: list[str] = []
        made: list[dict] = []  # the reply's calls (valid or not), OpenAI format
        # the same run agentspec serve answers with (agentspec.chat.run)
        chat, drafter, cache = prepared.chat, prepared.drafter, prepared.prefix_cache
        deltas = agentspec.chat.run(chat, drafter, cache, cancelled=cancelled)
        name = prepared.chat.pair.name
        try:
            for delta in deltas:
                errors.update((c["id"], c["error"]) for c in delta.calls if "error" in c)
                texts.append(delta.text)
                made += delta.calls
                calls = [_chunk_of_call(c, delta.first_index + i) for i, c in enumerate(delta.calls)]
                if delta.finish_reason is not None:
                    # the last chunk carries the call's record: close first (the cache saved)
                    record = deltas.close()
                    chunk = self._last_chunk(
                        delta.text, calls, delta.finish_reason, record, name, errors, response_id
                    )
                else:
                    message = AIMessageChunk(content=delta.text, tool_call_chunks=calls)
                    chunk = ChatGenerationChunk(message=message)
                if delta.logprobs is not None:  # merged across the chunks, as ChatOpenAI's
                    chunk.message.response_metadata["logprobs"] = {"content": delta.logprobs, "refusal": None}
                if run_manager is not None:
                    run_manager.on_llm_new_token(delta.text, chunk=chunk)
                yield chunk
        except BaseException as exc:
            trace.fail(exc)
            raise
        finally:
            record = deltas.close()  # releases the pair's lock (and lets the core save its cache) early
            trace.reply("".join(texts), made)
            trace.end(record)

    def _last_chunk(
        self,
        text: str,
        calls: list,
        reason: str,
        record: CallRecord,
        model_name: str,
        errors: dict,
        response_id: str,
    ) -> ChatGenerationChunk:
        stats = record.stats
        metadata = {
            "id": response_id,  # the span's gen_ai.response.id: a reply found from its trace, and back
            "model_name": model_name,
            "model_provider": PROVIDER,  # langchain-core reads content blocks by the provider's rules
            "finish_reason": reason,
            "speculative": _engine.engine().chat.speculative_metadata(stats),
            "stats": stats.as_dict(),
            # the span's figures, from the same record: time inside the decoder, the plain-decoding
            # estimate and their difference (agentspec.cost)
            "latency": {
                "decode_s": record.decode_s,
                "baseline_s": record.baseline_s,
                "latency_saved_s": record.latency_saved_s,
                "cost_source": record.cost_source,
            },
        }
        if errors:
            metadata["tool_call_errors"] = errors
        message = AIMessageChunk(
            content=text,
            tool_call_chunks=calls,
            chunk_position="last",
            usage_metadata=self._usage(stats),
            response_metadata=metadata,
        )
        return ChatGenerationChunk(message=message, generation_info={"finish_reason": reason})

    @staticmethod
    def _usage(stats: DecodeStats) -> UsageMetadata:
        return UsageMetadata(
            input_tokens=stats.prompt_tokens,
            output_tokens=stats.output_tokens,
            total_tokens=stats.prompt_tokens + stats.output_tokens,
            input_token_details={"cache_read": stats.cached_tokens},
        )

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        if self._remote is not None:
            options = self._remote_options(messages, stop, kwargs)
            return generate_from_stream(iter(self._remote.generate(options, run_manager)))
        return generate_from_stream(self._replies(messages, stop, run_manager, kwargs, streamed=False))

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        if self._remote is None:  # the local path: the reply's chunks on a worker thread, cancellable
            sync = run_manager.get_sync() if run_manager is not None else None
            replies = functools.partial(self._replies, messages, stop, sync, kwargs, False)
            async with contextlib.aclosing(self._on_worker(replies)) as chunks:  # closed when cancelled
                return generate_from_stream(iter([chunk async for chunk in chunks]))
        options = self._remote_options(messages, stop, kwargs)
        return generate_from_stream(iter(await self._remote.agenerate(options, run_manager)))

    def _remote_options(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict) -> dict:
        """A remote call's ``chat.completions.create`` arguments (``remote.request_options``)."""
        from langchain_agentspec.remote import request_options

        model = kwargs.get("model")
        if model is not None and model != self.model_name:
            raise ValueError(
                f"model={model!r}: this ChatSpecDecode asks {self.base_url} for {self.model_name!r}"
            )
        defaults = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_tokens": self.max_tokens,
            "seed": self.seed,
            "stop": self.stop,
            "logprobs": self.logprobs,
            "top_logprobs": self.top_logprobs,
        }
        kwargs = {k: v for k, v in kwargs.items() if k not in _IGNORED_CALL_ARGS}
        return request_options(self.model_name, messages, stop, kwargs, defaults)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        """``_stream`` on one worker thread, its chunks handed over through a queue (remote: the
        async client)."""
        if self._remote is not None:
            options = self._remote_options(messages, stop, kwargs)
            async for chunk in self._remote.astream(options, run_manager):
                yield chunk
            return
        sync = run_manager.get_sync() if run_manager is not None else None
        replies = functools.partial(self._replies, messages, stop, sync, kwargs, True)
        async with contextlib.aclosing(self._on_worker(replies)) as chunks:  # closed with this stream
            async for chunk in chunks:
                yield chunk

    @staticmethod
    async def _on_worker(
        replies: Callable[[threading.Event], Iterator[ChatGenerationChunk]],
    ) -> AsyncIterator[ChatGenerationChunk]:
        """``replies(cancelled)``'s chunks, made on one worker thread (the pair's lock must be released
        by the thread that took it) and handed over through a queue. A consumer that leaves (a
        cancelled task, a closed stream) sets ``cancelled``: the decoding takes no pass after the one
        in progress (``agentspec.chat.run``), and the worker is awaited, its state saved."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancelled = threading.Event()
        done = object()

        def produce() -> None:
            try:
                for chunk in replies(cancelled):
                    loop.call_soon_threadsafe(queue.put_nowait, (chunk, None))
                    if cancelled.is_set():
                        break  # leaving the loop closes the run, which releases the lock
            except BaseException as exc:  # handed to the consumer, raised there
                loop.call_soon_threadsafe(queue.put_nowait, (None, exc))
            else:
                loop.call_soon_threadsafe(queue.put_nowait, (done, None))

        worker = loop.run_in_executor(None, contextvars.copy_context().run, produce)
        try:
            while True:
                item, exc = await queue.get()
                if exc is not None:
                    raise exc
                if item is done:
                    break
                yield item
        finally:
            cancelled.set()
            await asyncio.shield(worker)

    def _tracing(self) -> Telemetry:
        """The engine's ``Telemetry`` for this instance's providers, built on the first call (one,
        when the first calls come from several threads: each would create its own instruments)."""
        with _TELEMETRY_LOCK:
            if self._telemetry is None:
                telemetry = _engine.engine().telemetry
                self._telemetry = telemetry.Telemetry(self.tracer_provider, self.meter_provider)
            return self._telemetry

    def _trace(
        self,
        prepared: _Prepared | None,
        run_manager: Any,
        streamed: bool,
        error: Exception | None = None,
        response_id: str | None = None,
    ) -> Any:
        """The ``agentspec.telemetry.CallTrace`` of a call made from ``_stream``; with ``error``, a call
        that failed before decoding, recorded at once.

        The span's parent is the span a LangChain tracer opened for this run, or the current span
        (``_run.late_parent``); its ``gen_ai.conversation.id`` is the run's thread or session id
        (``_run.run_conversation_id``); it leaves ``gen_ai.usage.*`` to the tracer's span as
        ``span_usage`` says.
        """
        telemetry = _engine.engine().telemetry
        chat = prepared.chat if prepared is not None else None
        usage = self.span_usage if self.span_usage is not None else not tracer_reports_usage(run_manager)
        info = telemetry.CallInfo(
            self.model_name,
            chat.config if chat is not None else None,
            prepared.prefix_cache if prepared is not None else True,
            streamed=streamed,
            parent=late_parent(run_manager),
            conversation_id=run_conversation_id(run_manager),
            response_id=response_id,
            request=chat.request if chat is not None else None,
            usage=usage,
        )
        trace = self._tracing().call(info)
        if error is not None:
            trace.fail(error)
            trace.end()
        return trace
