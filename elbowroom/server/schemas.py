"""Request bodies of the OpenAI text routes, validated strictly (a string is not a number).

Unknown fields are ignored (clients send many optional OpenAI params); the ones that would
change the output and that we cannot honour (n > 1, echo, suffix, non-text content parts)
are refused with a 400 naming them. docs/api.md lists every param.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

_STRICT = ConfigDict(strict=True, extra="ignore")

Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(ge=0.0, le=1.0)]
MaxTokens = Annotated[int, Field(ge=1)]
KeepAlive = int | float | str


class TextPart(BaseModel):
    model_config = _STRICT
    type: str
    text: str | None = None

    @field_validator("type")
    @classmethod
    def _only_text(cls, v: str) -> str:
        if v != "text":
            raise ValueError(f"content parts of type {v!r} are not supported; only 'text'")
        return v


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content)

    def to_engine(self) -> dict[str, Any]:
        # llama.cpp chat templates know system/user/assistant/tool; "developer" is
        # OpenAI's newer name for system.
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": self.text()}


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class _Sampling(BaseModel):
    """What both text routes share."""

    model_config = _STRICT
    model: str | None = None  # None: the server's default model
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: int | None = None
    # How many and how long: max_stop, max_stop_chars (checked in server.limits).
    stop: str | list[str] | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    keep_alive: KeepAlive | None = None
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

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling(self, max_tokens: int | None) -> dict[str, Any]:
        """The engine payload's sampling keys (base.py); None lets the engine choose."""
        return {
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "stop": self.stop_list(),
        }


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: MaxTokens | None = None

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """The value and the param that gave it: OpenAI's newer name wins when both are sent."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


class CompletionRequest(_Sampling):
    prompt: str | list[str]
    echo: bool | None = False
    suffix: str | None = None

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

    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    def requested_max_tokens(self) -> tuple[int | None, str]:
        return self.max_tokens, "max_tokens"
