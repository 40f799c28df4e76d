"""Request bodies of the OpenAI text routes, validated strictly (a string is not a number).

Every param is one of three kinds, and docs/api.md lists each:

- **supported**: validated here, honoured by the engine;
- **accepted and ignored**: OpenAI params that change nothing about the output
  (``user``, ``metadata``, ``store``, ...): typed, so a wrong type is still a 400;
- **refused**: OpenAI params we cannot honour (``n`` > 1, ``audio``, ``functions``, ...)
  are a 400 that names the param and says what to send instead.

Anything else is a 400 naming the unknown param (``extra="forbid"``): a typo or a param of
another API is never silently ignored.

This is the one validation of a text request: ``to_engine`` turns a valid body into the
engine's ``TextRequest`` (engines/requests.py), which the engine translates without
checking it again.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, TypedDict

from pydantic import BaseModel, Field, ValidationInfo, field_validator

from elbowroom.engines.requests import TextRequest
from elbowroom.errors import BadRequest
from elbowroom.server.openai.chat_schemas import (
    STRICT,
    ChatMessage,
    NamedToolChoice,
    ResponseFormat,
    Tool,
    parse_tool_choice,
)

Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(ge=0.0, le=1.0)]
MaxTokens = Annotated[int, Field(ge=1)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]
Seed = Annotated[int, Field(ge=-(1 << 63), le=(1 << 63) - 1)]
KeepAlive = int | float | str

# llama.cpp seeds are 32-bit and 0xFFFFFFFF means "pick one at random": a client's 64-bit
# seed is reduced modulo this, so every seed samples repeatably.
SEED_MODULUS = 0xFFFFFFFF
MAX_TOP_LOGPROBS = 20  # chat (OpenAI's limit)
MAX_LEGACY_LOGPROBS = 5  # /v1/completions (OpenAI's limit)
# llama.cpp samplers both routes take under llama.cpp's (and Ollama's) names, passed through.
SAMPLERS = (
    "top_k",
    "min_p",
    "typical_p",
    "repeat_penalty",
    "repeat_last_n",
    "mirostat",
    "mirostat_tau",
    "mirostat_eta",
)


# Above this a max_tokens is a client bug, not a wish: 400 instead of clamping.
ABSURD_MAX_TOKENS = 1 << 20


def refuse_absurd(value: int | None, param: str, cap: int) -> None:
    """A token limit above ABSURD_MAX_TOKENS is a 400 on every route (OpenAI's
    ``max_tokens``, the Responses API's ``max_output_tokens``, Ollama's ``num_predict``);
    below it ``max_tokens_cap`` (``cap``) applies (text_calls.engine_request)."""
    if value is not None and value > ABSURD_MAX_TOKENS:
        raise BadRequest(
            f"{param}={value} is absurd: no context holds more than {ABSURD_MAX_TOKENS} "
            f"tokens; this server generates at most {cap} per request (max_tokens_cap)",
            param=param,
            code="invalid_value",
        )


class _SharedFields(TypedDict):
    """What both text routes put into a TextRequest (typed, so mypy checks the ``**``)."""

    temperature: float | None
    top_p: float | None
    seed: int | None
    stop: tuple[str, ...]
    presence_penalty: float | None
    frequency_penalty: float | None
    logit_bias: dict[str, float] | None
    samplers: dict[str, int | float] | None
    isolated: bool
    stream: bool


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False
    include_obfuscation: bool | None = None  # accepted and ignored: nothing is obfuscated


class _Refusing(BaseModel):
    """Declares OpenAI params that are refused whenever they carry a value (null is
    absence). Subclasses name them with the reason and the fix."""

    REFUSED: ClassVar[dict[str, str]] = {}

    @classmethod
    def refuse(cls, name: str, value: Any) -> None:
        if value is not None and name in cls.REFUSED:
            raise ValueError(cls.REFUSED[name])


class _Sampling(_Refusing):
    """What both text routes share."""

    model_config = STRICT
    model: str | None = None  # None: the server's default model
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: Seed | None = None
    # How many and how long: max_stop, max_stop_chars (checked in server.limits).
    stop: str | list[str] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Bias] | None = None
    # llama.cpp's own samplers, as its server takes them on /v1 (Ollama's options of the
    # same names map here): SAMPLERS.
    top_k: Annotated[int, Field(ge=0)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    typical_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repeat_penalty: Annotated[float, Field(ge=0.0)] | None = None
    repeat_last_n: Annotated[int, Field(ge=-1)] | None = None
    mirostat: Annotated[int, Field(ge=0, le=2)] | None = None
    mirostat_tau: Annotated[float, Field(ge=0.0)] | None = None
    mirostat_eta: Annotated[float, Field(ge=0.0)] | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    keep_alive: KeepAlive | None = None  # elbowroom's (Ollama's) own
    # Cache isolation (vLLM's name): a salted request shares no KV state with any other.
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    user: str | None = None  # accepted and ignored

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise ValueError(f"n={v} is not supported: elbowroom returns exactly one choice (n=1)")
        return v

    @field_validator("model")
    @classmethod
    def _model_named(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("model must not be empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or {}:
            # ASCII digits only ("²" is a digit to str.isdigit, not to int) and short: a
            # token id has at most 10 digits; a 5,000-digit key was a 500.
            if not (key.isascii() and key.isdigit() and len(key) <= 10):
                raise ValueError(
                    f"logit_bias keys are token ids as strings (e.g. '42'), not {key!r}"
                )
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def token_ids(self) -> list[int]:
        """The token ids ``logit_bias`` names (the route checks them against the vocabulary)."""
        return [int(k) for k in self.logit_bias or {}]

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """The value and the param that gave it."""
        return self.max_tokens, "max_tokens"

    def _sampling(self) -> _SharedFields:
        """The TextRequest fields both routes share; None lets the engine choose."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": None if self.seed is None else self.seed % SEED_MODULUS,
            "stop": tuple(self.stop_list()),
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "logit_bias": self.logit_bias,
            "samplers": {k: v for k in SAMPLERS if (v := getattr(self, k)) is not None} or None,
            "isolated": self.cache_salt is not None,
            "stream": bool(self.stream),
        }


class ChatCompletionRequest(_Sampling):
    REFUSED: ClassVar[dict[str, str]] = {
        "functions": "functions (deprecated by OpenAI) is not supported: send tools",
        "function_call": "function_call (deprecated by OpenAI) is not supported: send tool_choice",
        "audio": "audio output is not supported: these models write text",
        "prediction": "predicted outputs (prediction) are not supported",
        "web_search_options": "web search is not supported",
        "reasoning_effort": "reasoning_effort is not supported by these models",
        "verbosity": "verbosity is not supported by these models",
    }

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Tool], Field(min_length=1, max_length=128)] | None = None
    tool_choice: Any = None  # parse_tool_choice: a mode or a NamedToolChoice
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    modalities: list[str] | None = None  # ["text"] only
    # Accepted and ignored (docs/api.md says why each is harmless).
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # Refused whenever set (REFUSED says why).
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None

    @field_validator(*REFUSED)
    @classmethod
    def _refused(cls, v: Any, info: ValidationInfo) -> Any:
        cls.refuse(str(info.field_name), v)
        return v

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and v != ["text"]:
            raise ValueError(f"modalities {v} is not supported: these models write ['text'] only")
        return v

    @field_validator("messages")
    @classmethod
    def _tool_results_answer_calls(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        called: set[str] = set()
        for i, msg in enumerate(v):
            called.update(call.id for call in msg.tool_calls or ())
            if msg.role == "tool" and msg.tool_call_id not in called:
                raise ValueError(
                    f"messages[{i}] answers tool_call_id {msg.tool_call_id!r}, which no earlier "
                    "assistant message's tool_calls has"
                )
        return v

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(cls, v: Any, info: ValidationInfo) -> Any:
        choice = parse_tool_choice(v)
        if "tools" not in info.data:  # tools itself failed: that error is the one to show
            return choice
        tools: list[Tool] = info.data["tools"] or []
        if (isinstance(choice, NamedToolChoice) or choice == "required") and not tools:
            raise ValueError(f"tool_choice {_show(choice)} needs tools")
        if isinstance(choice, NamedToolChoice):
            names = [t.function.name for t in tools]
            if choice.function.name not in names:
                raise ValueError(
                    f"tool_choice names {choice.function.name!r}, which is not in tools "
                    f"({', '.join(names)})"
                )
        return choice

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, v: list[Tool] | None) -> list[Tool] | None:
        names = [t.function.name for t in v or ()]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"tool names must be unique; repeated: {', '.join(dupes)}")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """The value and the param that gave it: OpenAI's newer name wins when both are sent."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def top_count(self) -> int | None:
        """Alternatives per token the client asked for; None: no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def to_engine(
        self, max_tokens: int, messages: list[dict[str, Any]] | None = None
    ) -> TextRequest:
        """The engine's request (``max_tokens`` already clamped by the caller);
        ``messages`` replaces the schema's own engine messages (the Ollama route keeps
        its conversation's tool calls)."""
        choice = self.tool_choice
        if messages is None:
            messages = [m.to_engine() for m in self.messages]
        return TextRequest(
            kind="chat",
            max_tokens=max_tokens,
            messages=tuple(messages),
            response_format=self.response_format.to_engine() if self.response_format else None,
            tools=tuple(t.model_dump(exclude_none=True) for t in self.tools or ()),
            tool_choice=choice.model_dump() if isinstance(choice, NamedToolChoice) else choice,
            parallel_tool_calls=self.parallel_tool_calls,
            # The engine sends no logprobs at all for top_logprobs 0: ask for one
            # alternative and drop it in the response (shapes.Logprobs).
            logprobs=max(1, self.top_logprobs or 0) if self.logprobs else None,
            **self._sampling(),
        )


class CompletionRequest(_Sampling):
    prompt: str | list[str]
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None
    # Legacy: the number of most likely alternatives per token, 0..5.
    logprobs: Annotated[int, Field(ge=0, le=MAX_LEGACY_LOGPROBS)] | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_string(cls, v: Any) -> Any:
        if isinstance(v, list) and (len(v) != 1 or not isinstance(v[0], str)):
            raise ValueError(
                "prompt must be a string or a list of one string; token arrays and "
                "batches of prompts are not supported"
            )
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("echo=true is not supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix (insertion) is not supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of_one(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise ValueError(f"best_of={v} is not supported: elbowroom samples one completion")
        return v

    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    def top_count(self) -> int | None:
        return self.logprobs

    def to_engine(
        self, max_tokens: int, messages: list[dict[str, Any]] | None = None
    ) -> TextRequest:
        return TextRequest(
            kind="completion",
            max_tokens=max_tokens,
            prompt=self.prompt_text(),
            # As for chat: ask for at least one alternative, so the engine sends logprobs.
            logprobs=None if self.logprobs is None else max(1, self.logprobs),
            **self._sampling(),
        )


def _show(choice: Any) -> str:
    if isinstance(choice, NamedToolChoice):
        return f"{{'type': 'function', 'function': {{'name': {choice.function.name!r}}}}}"
    return repr(choice)
