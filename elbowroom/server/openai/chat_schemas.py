"""PURE: the parts of a chat request body that describe a conversation and its tools:
messages (content parts, assistant tool calls, tool results), ``tools``, ``tool_choice``
and ``response_format``. Validated strictly: the engine itself replaces values of the
wrong type with defaults, so nothing reaches it unchecked.

Unions are avoided where pydantic would put the member's name into the error location
(``tool_choice.NamedToolChoice.function``): one model with optional fields and a check
keeps every 400's ``param`` a path the client wrote.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

STRICT = ConfigDict(strict=True, extra="forbid")

# OpenAI's rule for function and schema names.
Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
PartType = Literal["text", "image_url", "input_audio", "file", "refusal"]
_PART_PAYLOAD = {
    "text": "text",
    "image_url": "image_url",
    "input_audio": "input_audio",
    "file": "file",
    "refusal": "refusal",
}
# Which part types each role may send (OpenAI's rules); which of them a model can read is
# the route's question (openai_routes._check_for_model).
_PARTS_FOR_ROLE: dict[str, frozenset[str]] = {
    "system": frozenset({"text"}),
    "developer": frozenset({"text"}),
    "tool": frozenset({"text"}),
    "assistant": frozenset({"text", "refusal"}),
    "user": frozenset({"text", "image_url", "input_audio", "file"}),
}


class ContentPart(BaseModel):
    model_config = STRICT
    type: PartType
    text: str | None = None
    refusal: str | None = None
    image_url: dict[str, Any] | None = None
    input_audio: dict[str, Any] | None = None
    file: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _payload_matches_type(self) -> ContentPart:
        key = _PART_PAYLOAD[self.type]
        if getattr(self, key) is None:
            raise ValueError(f"a content part of type {self.type!r} needs the field {key!r}")
        others = [k for k in _PART_PAYLOAD.values() if k != key and getattr(self, k) is not None]
        if others:
            raise ValueError(f"a content part of type {self.type!r} cannot carry {others[0]!r}")
        return self


class FunctionCall(BaseModel):
    model_config = STRICT
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(BaseModel):
    """A call an earlier assistant turn made (sent back in a multi-turn conversation)."""

    model_config = STRICT
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None  # accepted and ignored: chat templates do not render it
    tool_calls: Annotated[list[ToolCall], Field(min_length=1)] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None  # an earlier assistant refusal: accepted, not rendered

    @model_validator(mode="after")
    def _fields_fit_the_role(self) -> ChatMessage:
        role = self.role
        if self.tool_calls is not None and role != "assistant":
            raise ValueError(f"only assistant messages carry tool_calls, not role {role!r}")
        if role == "tool" and not self.tool_call_id:
            raise ValueError("a message of role 'tool' needs the tool_call_id it answers")
        if role != "tool" and self.tool_call_id is not None:
            raise ValueError(f"only tool messages carry tool_call_id, not role {role!r}")
        if self.refusal is not None and role != "assistant":
            raise ValueError(f"only assistant messages carry refusal, not role {role!r}")
        if self.content is None and not (role == "assistant" and (self.tool_calls or self.refusal)):
            raise ValueError(f"a message of role {role!r} needs content")
        if isinstance(self.content, list):
            allowed = _PARTS_FOR_ROLE[role]
            for part in self.content:
                if part.type not in allowed:
                    raise ValueError(
                        f"a message of role {role!r} cannot carry content parts of type "
                        f"{part.type!r} (allowed: {', '.join(sorted(allowed))})"
                    )
        return self

    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(p.type == "image_url" for p in self.content)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content if part.type == "text")

    def to_engine(self) -> dict[str, Any]:
        """The engine's OpenAI message dict. "developer" is OpenAI's newer name for system,
        which llama.cpp's chat templates know."""
        role = "system" if self.role == "developer" else self.role
        msg: dict[str, Any] = {"role": role, "content": self.text()}
        if self.has_images():
            # Vision: text and images in order, as OpenAI parts (server/openai/images.py has checked
            # every image and made its url a data: URL).
            msg["content"] = [
                {"type": "image_url", "image_url": {"url": (p.image_url or {}).get("url")}}
                if p.type == "image_url"
                else {"type": "text", "text": p.text or ""}
                for p in self.content or ()
                if isinstance(p, ContentPart) and p.type in ("text", "image_url")
            ]
        if self.tool_calls:
            msg["tool_calls"] = [call.model_dump() for call in self.tool_calls]
            if self.content is None:
                msg["content"] = None
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        return msg


class FunctionDefinition(BaseModel):
    model_config = STRICT
    name: Name
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of an object
    strict: bool | None = None  # the arguments always follow the schema: see docs/api.md

    @field_validator("parameters")
    @classmethod
    def _an_object_schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and v.get("type", "object") != "object":
            raise ValueError(
                "parameters must be a JSON schema of an object ({'type': 'object', ...}): "
                "a function's arguments are a JSON object"
            )
        return v


class Tool(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: NamedFunction


TOOL_CHOICE_MODES = ("none", "auto", "required")


def parse_tool_choice(value: Any) -> str | NamedToolChoice | None:
    """``"none" | "auto" | "required"`` or ``{"type": "function", "function": {"name"}}``;
    any other value is a ValueError that says which forms exist."""
    if value is None or isinstance(value, NamedToolChoice):
        return value
    if isinstance(value, str):
        if value not in TOOL_CHOICE_MODES:
            raise ValueError(
                f"tool_choice {value!r} is not one of 'none', 'auto', 'required' or "
                "{'type': 'function', 'function': {'name': ...}}"
            )
        return value
    if isinstance(value, dict):
        try:
            return NamedToolChoice.model_validate(value)
        except ValueError as exc:
            raise ValueError(
                "a named tool_choice is {'type': 'function', 'function': {'name': ...}} "
                f"({_first_reason(exc)})"
            ) from None
    raise ValueError(
        "tool_choice must be 'none', 'auto', 'required' or "
        "{'type': 'function', 'function': {'name': ...}}"
    )


class JsonSchemaFormat(BaseModel):
    model_config = STRICT
    name: Name
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the output always follows the schema: see docs/api.md


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError(
                "type 'json_schema' needs json_schema: "
                "{'name': ..., 'schema': {...}, 'strict': true}"
            )
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"json_schema goes with type 'json_schema', not {self.type!r}")
        return self

    def to_engine(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        if self.json_schema is not None:
            out["json_schema"] = self.json_schema.model_dump(by_alias=True, exclude_none=True)
        return out


def _first_reason(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        first = errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        return f"{where}: {first.get('msg', '')}" if where else str(first.get("msg", ""))
    return str(exc)
