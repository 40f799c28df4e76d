"""PURE: OpenAI's Responses API (``POST /v1/responses``) translated to and from the chat path.

A Responses request becomes the chat request the chat route validates and runs
(``ResponsesRequest.chat_body``): ``instructions`` a system message, then the stored
conversation a ``previous_response_id`` continues, then the ``input`` items (messages
with ``input_text`` / ``input_image`` parts, ``function_call`` items as an assistant's
``tool_calls``, ``function_call_output`` items as ``tool`` messages); function tools,
``tool_choice`` and ``text.format`` in their chat forms. The chat answer (a completion,
or its stream of chunks) becomes a Response object (``Turn.response``) or the typed
events of a Responses stream (``StreamTranslator``), shaped as the ``openai`` package's
``openai.types.responses`` models parse them.

What cannot be honoured is a 400 naming the field: hosted tools (web search, file
search, computer use, ...), ``background``, ``conversation``, ``reasoning``, stored
prompts, file inputs. docs/api.md#responses lists every field.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, Field, ValidationError, ValidationInfo, field_validator

from elbowroom.errors import BadRequest
from elbowroom.server.errors import validation_to_bad_request
from elbowroom.server.openai.chat_schemas import STRICT, Name
from elbowroom.server.openai.responses_store import new_id
from elbowroom.server.openai.schemas import KeepAlive, MaxTokens, Temperature, TopP

HOSTED_TOOLS = (
    "web_search",
    "web_search_preview",
    "file_search",
    "computer_use",
    "computer_use_preview",
    "code_interpreter",
    "image_generation",
    "mcp",
    "local_shell",
    "shell",
    "custom",
    "apply_patch",
)


class ResponsesStreamOptions(BaseModel):
    model_config = STRICT
    include_obfuscation: bool | None = None  # accepted and ignored: nothing is obfuscated


class TextFormat(BaseModel):
    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"]
    name: Name | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    def to_chat(self) -> dict[str, Any] | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        if self.name is None or self.schema_ is None:
            raise BadRequest(
                "text.format of type 'json_schema' needs a name and a schema",
                param="text.format",
                code="invalid_value",
            )
        spec: dict[str, Any] = {"name": self.name, "schema": self.schema_}
        if self.description is not None:
            spec["description"] = self.description
        if self.strict is not None:
            spec["strict"] = self.strict
        return {"type": "json_schema", "json_schema": spec}

    def shown(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        if self.type == "json_schema":
            out.update(name=self.name, schema=self.schema_, strict=self.strict)
            if self.description is not None:
                out["description"] = self.description
        return out


class TextConfig(BaseModel):
    model_config = STRICT
    format: TextFormat | None = None
    verbosity: Any = None

    @field_validator("verbosity")
    @classmethod
    def _no_verbosity(cls, v: Any) -> Any:
        if v is not None:
            raise ValueError("verbosity is not supported by these models")
        return v


class FunctionTool(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    name: Name
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def to_chat(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        if self.parameters is not None:
            fn["parameters"] = self.parameters
        if self.strict is not None:
            fn["strict"] = self.strict
        return {"type": "function", "function": fn}

    def shown(self) -> dict[str, Any]:
        return {
            "type": "function",
            "name": self.name,
            "description": self.description,
            "parameters": self.parameters,
            "strict": self.strict,
        }


# Message items and their parts, as clients send them back (also what this server returns).
class _Part(BaseModel):
    model_config = STRICT
    type: Literal["input_text", "output_text", "input_image", "refusal", "input_file"]
    text: str | None = None
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["auto", "low", "high", "original"] | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None  # output_text: accepted, not rendered
    logprobs: list[Any] | None = None  # output_text: accepted, not rendered


class _MessageItem(BaseModel):
    model_config = STRICT
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[_Part]
    id: str | None = None
    status: str | None = None
    phase: str | None = None  # accepted and ignored


class _FunctionCallItem(BaseModel):
    model_config = STRICT
    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class _OutputPart(BaseModel):
    model_config = STRICT
    type: Literal["input_text", "output_text"]
    text: str


class _FunctionCallOutputItem(BaseModel):
    model_config = STRICT
    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1)]
    output: str | list[_OutputPart]
    id: str | None = None
    status: str | None = None


_ROLE_PARTS = {
    "user": {"input_text", "input_image"},
    "system": {"input_text"},
    "developer": {"input_text"},
    "assistant": {"output_text", "refusal", "input_text"},
}


class ResponsesRequest(BaseModel):
    """The body of ``POST /v1/responses``: supported, accepted-and-ignored and refused
    fields as for the chat route (server/openai/schemas.py); anything else is a 400."""

    REFUSED: ClassVar[dict[str, str]] = {
        "background": "background responses are not supported: send the request and wait "
        "(or stream it)",
        "conversation": "conversation objects are not supported: continue a stored response "
        "with previous_response_id",
        "prompt": "stored prompt templates (prompt) are not supported: send instructions and input",
        "reasoning": "reasoning options are not supported by these models",
        "top_logprobs": "top_logprobs is not supported on /v1/responses: use "
        "/v1/chat/completions with logprobs",
        "max_tool_calls": "max_tool_calls is not supported",
        "context_management": "context_management is not supported",
        "moderation": "moderation is not supported",
        "image": "image options are not supported: these models write text",
        "access_programs": "access_programs is not supported",
        "background_options": "background responses are not supported",
        "prompt_cache_options": "prompt_cache_options is not supported: the prompt cache is "
        "automatic (docs/kvcache.md)",
    }

    model_config = STRICT
    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    tools: Annotated[list[Any], Field(max_length=128)] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: Annotated[dict[str, Annotated[str, Field(max_length=512)]], Field(max_length=16)] | (
        None
    ) = None
    stream: bool | None = False
    stream_options: ResponsesStreamOptions | None = None
    keep_alive: KeepAlive | None = None  # elbowroom's (Ollama's) own
    truncation: Literal["disabled", "auto"] | None = None
    include: list[str] | None = None
    # Accepted and ignored (docs/api.md says why each is harmless).
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    # Refused whenever set (REFUSED says why); background: false is no request.
    background: Any = None
    conversation: Any = None
    prompt: Any = None
    reasoning: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None
    context_management: Any = None
    moderation: Any = None
    image: Any = None
    access_programs: Any = None
    background_options: Any = None
    prompt_cache_options: Any = None

    @field_validator(*REFUSED)
    @classmethod
    def _refused(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None and v is not False:
            raise ValueError(cls.REFUSED[str(info.field_name)])
        return v

    @field_validator("truncation")
    @classmethod
    def _no_auto_truncation(cls, v: str | None) -> str | None:
        if v == "auto":
            raise ValueError(
                "truncation 'auto' is not supported: a conversation over the context is a 400 "
                "(context_length_exceeded); send 'disabled' or leave it out"
            )
        return v

    @field_validator("include")
    @classmethod
    def _nothing_to_include(cls, v: list[str] | None) -> list[str] | None:
        if v:
            raise ValueError(
                f"include {v[0]!r} is not supported: nothing beyond the default output is available"
            )
        return v

    @field_validator("metadata")
    @classmethod
    def _short_keys(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        for key in v or {}:
            if len(key) > 64:
                raise ValueError("metadata keys have at most 64 characters")
        return v

    @field_validator("input")
    @classmethod
    def _some_input(cls, v: str | list[Any]) -> str | list[Any]:
        if isinstance(v, list) and not v:
            raise ValueError("input must not be an empty list")
        return v

    # ---- translation -------------------------------------------------------------------

    def function_tools(self) -> list[FunctionTool]:
        out = []
        for i, tool in enumerate(self.tools or ()):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind in HOSTED_TOOLS or (isinstance(kind, str) and kind.startswith("web_search")):
                raise BadRequest(
                    f"The hosted tool {kind!r} is not supported: elbowroom runs no tools "
                    "itself. Send function tools ({'type': 'function', 'name': ..., "
                    "'parameters': {...}}) and run them in your code.",
                    param=f"tools[{i}].type",
                    code="unsupported_tool",
                )
            out.append(_validated(FunctionTool, tool, f"tools[{i}]"))
        names = [t.name for t in out]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise BadRequest(
                f"tool names must be unique; repeated: {', '.join(dupes)}",
                param="tools",
                code="invalid_value",
            )
        return out

    def chat_tool_choice(self) -> Any:
        choice = self.tool_choice
        if choice is None or isinstance(choice, str):
            return choice  # the chat schema checks the mode and that tools exist
        if isinstance(choice, dict) and choice.get("type") == "function":
            if set(choice) != {"type", "name"} or not isinstance(choice.get("name"), str):
                raise BadRequest(
                    "a named tool_choice is {'type': 'function', 'name': ...}",
                    param="tool_choice",
                    code="invalid_value",
                )
            return {"type": "function", "function": {"name": choice["name"]}}
        kind = choice.get("type") if isinstance(choice, dict) else None
        raise BadRequest(
            f"tool_choice {kind or choice!r} is not supported: send 'none', 'auto', "
            "'required' or {'type': 'function', 'name': ...}",
            param="tool_choice",
            code="invalid_value",
        )

    def input_items(self) -> list[dict[str, Any]]:
        """The input as items with ids (what ``input_items`` lists), checked."""
        if isinstance(self.input, str):
            return [_user_text(self.input)]
        items = []
        for i, raw in enumerate(self.input):
            items.append(_input_item(raw, f"input[{i}]"))
        return items

    def chat_body(
        self, model: str, history: list[dict[str, Any]], new: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """The chat request for this body: ``history`` (a stored conversation) and ``new``
        (this input's chat messages) after the instructions."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        messages += history + new
        body: dict[str, Any] = {"model": model, "messages": messages, "stream": bool(self.stream)}
        optional = {
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "parallel_tool_calls": self.parallel_tool_calls,
            "keep_alive": self.keep_alive,
            "tool_choice": self.chat_tool_choice(),
        }
        body.update({k: v for k, v in optional.items() if v is not None})
        tools = self.function_tools()
        if tools:
            body["tools"] = [t.to_chat() for t in tools]
        fmt = self.text.format.to_chat() if self.text and self.text.format else None
        if fmt is not None:
            body["response_format"] = fmt
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        return body


def _validated(model: type[BaseModel], raw: Any, where: str) -> Any:
    """``raw`` as ``model``; a 400 whose param is the path the client wrote."""
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        err = validation_to_bad_request(exc.errors())
        param = f"{where}.{err.param}" if err.param else where
        message = err.message.replace(repr(err.param), repr(param)) if err.param else err.message
        raise BadRequest(message, param=param, code=err.code) from None


def _user_text(text: str) -> dict[str, Any]:
    return {
        "id": new_id("msg"),
        "type": "message",
        "role": "user",
        "status": "completed",
        "content": [{"type": "input_text", "text": text}],
    }


def _input_item(raw: Any, where: str) -> dict[str, Any]:
    """One input item, checked, in the form ``GET .../input_items`` returns it."""
    if not isinstance(raw, dict):
        raise BadRequest(f"{where} must be an object (an input item)", param=where)
    kind = raw.get("type", "message")
    if kind == "message":
        msg: _MessageItem = _validated(_MessageItem, raw, where)
        text = msg.content if isinstance(msg.content, str) else ""
        parts = (
            [
                _Part(
                    type="output_text" if msg.role == "assistant" else "input_text",
                    text=msg.content,
                )
            ]
            if isinstance(msg.content, str)
            else msg.content
        )
        content = []
        for j, part in enumerate(parts):
            at = f"{where}.content[{j}]"
            if part.type not in _ROLE_PARTS[msg.role]:
                why = (
                    "file inputs are not supported: send the file's text as input_text"
                    if part.type == "input_file"
                    else f"a {msg.role} message cannot carry {part.type!r} parts"
                )
                raise BadRequest(f"{why} ({at})", param=f"{at}.type", code="invalid_value")
            content.append(_checked_part(part, at))
        if msg.role == "assistant":
            return {
                "id": msg.id or new_id("msg"),
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": content,
            }
        return {
            "id": msg.id or new_id("msg"),
            "type": "message",
            "role": msg.role,
            "status": "completed",
            "content": content,
        }
    if kind == "function_call":
        call: _FunctionCallItem = _validated(_FunctionCallItem, raw, where)
        return {
            "id": call.id or new_id("fc"),
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
            "status": "completed",
        }
    if kind == "function_call_output":
        out: _FunctionCallOutputItem = _validated(_FunctionCallOutputItem, raw, where)
        text = out.output if isinstance(out.output, str) else "".join(p.text for p in out.output)
        return {
            "id": out.id or new_id("fco"),
            "type": "function_call_output",
            "call_id": out.call_id,
            "output": text,
            "status": "completed",
        }
    raise BadRequest(
        f"input items of type {kind!r} are not supported: send messages, function_call and "
        f"function_call_output items ({where})",
        param=f"{where}.type",
        code="invalid_value",
    )


def _checked_part(part: _Part, at: str) -> dict[str, Any]:
    if part.type in ("input_text", "output_text"):
        if part.text is None:
            raise BadRequest(f"a {part.type} part needs text ({at})", param=f"{at}.text")
        if part.type == "output_text":
            return {"type": "output_text", "text": part.text, "annotations": []}
        return {"type": "input_text", "text": part.text}
    if part.type == "refusal":
        return {"type": "refusal", "refusal": part.refusal or ""}
    if part.image_url is None:
        raise BadRequest(
            f"an input_image needs image_url (a data: URL or an http(s) URL); file_id needs "
            f"a files API this server does not have ({at})",
            param=f"{at}.image_url",
        )
    return {"type": "input_image", "image_url": part.image_url, "detail": part.detail or "auto"}


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input (or output) items as chat messages: consecutive function calls join the
    assistant message before them (one turn), outputs become ``tool`` messages."""
    messages: list[dict[str, Any]] = []
    for item in items:
        kind = item["type"]
        if kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
            )
        else:
            messages.append(_chat_message(item))
    return messages


def _chat_message(item: dict[str, Any]) -> dict[str, Any]:
    role = item["role"]
    parts = item["content"]
    if role == "assistant":
        text = "".join(p.get("text") or p.get("refusal") or "" for p in parts)
        return {"role": "assistant", "content": text}
    if any(p["type"] == "input_image" for p in parts):
        return {
            "role": role,
            "content": [
                {"type": "image_url", "image_url": {"url": p["image_url"], "detail": p["detail"]}}
                if p["type"] == "input_image"
                else {"type": "text", "text": p["text"]}
                for p in parts
            ],
        }
    return {"role": role, "content": "".join(p["text"] for p in parts)}


# ---- the answer ----------------------------------------------------------------------------


def usage_of(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if not chat_usage:
        return None
    details = chat_usage.get("prompt_tokens_details") or {}
    prompt = int(chat_usage.get("prompt_tokens", 0))
    completion = int(chat_usage.get("completion_tokens", 0))
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": int(details.get("cached_tokens") or 0),
            "cache_write_tokens": 0,
        },
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        if status != "in_progress"
        else [],
    }


def call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str = "completed"
) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


@dataclass
class Turn:
    """One response being made: what the Response object repeats of its request."""

    body: ResponsesRequest
    model: str
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        incomplete: str | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        body = self.body
        fmt = body.text.format if body.text and body.text.format else None
        choice = body.tool_choice
        if isinstance(choice, dict):
            choice = {"type": "function", "name": choice.get("name")}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "text": {"format": fmt.shown() if fmt else {"type": "text"}},
            "tool_choice": choice if choice is not None else "auto",
            "tools": [t.shown() for t in body.function_tools()],
            "truncation": "disabled",
            "usage": usage,
            "metadata": body.metadata or {},
            "store": body.store is not False,
            "background": False,
            "user": body.user,
        }

    def from_completion(self, completion: dict[str, Any]) -> dict[str, Any]:
        """A chat completion (non-streamed) as the Response object."""
        choice = (completion.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        output: list[dict[str, Any]] = []
        text = message.get("content") or ""
        calls = message.get("tool_calls") or []
        if text or not calls:
            output.append(message_item(new_id("msg"), text))
        for call in calls:
            fn = call.get("function") or {}
            output.append(
                call_item(
                    new_id("fc"),
                    str(call.get("id") or new_id("call")),
                    str(fn.get("name", "")),
                    str(fn.get("arguments", "")),
                )
            )
        return self.finished(output, choice.get("finish_reason"), completion.get("usage"))

    def finished(
        self, output: list[dict[str, Any]], finish: Any, chat_usage: dict[str, Any] | None
    ) -> dict[str, Any]:
        if finish == "length":
            for item in output:
                item["status"] = "incomplete"
            return self.response("incomplete", output, usage_of(chat_usage), "max_output_tokens")
        return self.response("completed", output, usage_of(chat_usage))


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output as the chat messages that continue its conversation."""
    return chat_messages([item for item in output if item["type"] in ("message", "function_call")])


class StreamTranslator:
    """Chat chunks in, Responses stream events out (``event: TYPE`` + ``data: {...}``,
    each with its ``sequence_number``)."""

    def __init__(self, turn: Turn) -> None:
        self.turn = turn
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.text_item: dict[str, Any] | None = None
        self.text = ""
        self.calls: dict[int, dict[str, Any]] = {}  # the chat chunk's tool call index -> item
        self.finish: Any = None
        self.usage: dict[str, Any] | None = None
        self.final: dict[str, Any] | None = None  # the last Response object, once done

    def event(self, kind: str, **data: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return (
            f"event: {kind}\n".encode()
            + b"data: "
            + json.dumps(payload, separators=(",", ":")).encode()
            + b"\n\n"
        )

    def start(self) -> list[bytes]:
        snapshot = self.turn.response("in_progress", [])
        return [
            self.event("response.created", response=snapshot),
            self.event("response.in_progress", response=snapshot),
        ]

    def chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        """One chat chunk's events (the usage chunk and the last one carry none)."""
        out: list[bytes] = []
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            content = delta.get("content")
            if content:
                out += self._text(str(content))
            for call in delta.get("tool_calls") or ():
                out += self._call(call)
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return out

    def _text(self, delta: str) -> list[bytes]:
        out = []
        if self.text_item is None:
            out += self._close_calls()
            self.text_item = message_item(new_id("msg"), "", "in_progress")
            self.output.append(self.text_item)
            index = len(self.output) - 1
            out.append(
                self.event("response.output_item.added", output_index=index, item=self.text_item)
            )
            out.append(
                self.event(
                    "response.content_part.added",
                    item_id=self.text_item["id"],
                    output_index=index,
                    content_index=0,
                    part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
                )
            )
        self.text += delta
        out.append(
            self.event(
                "response.output_text.delta",
                item_id=self.text_item["id"],
                output_index=self.output.index(self.text_item),
                content_index=0,
                delta=delta,
                logprobs=[],
            )
        )
        return out

    def _call(self, call: dict[str, Any]) -> list[bytes]:
        out = []
        index = int(call.get("index", 0))
        fn = call.get("function") or {}
        item = self.calls.get(index)
        if item is None:
            out += self._close_text()
            item = call_item(
                new_id("fc"),
                str(call.get("id") or new_id("call")),
                str(fn.get("name") or ""),
                "",
                "in_progress",
            )
            self.calls[index] = item
            self.output.append(item)
            out.append(
                self.event(
                    "response.output_item.added", output_index=len(self.output) - 1, item=item
                )
            )
        elif fn.get("name"):
            item["name"] += str(fn["name"])
        arguments = str(fn.get("arguments") or "")
        if arguments:
            item["arguments"] += arguments
            out.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=self.output.index(item),
                    delta=arguments,
                )
            )
        return out

    def _item_status(self) -> str:
        return "incomplete" if self.finish == "length" else "completed"

    def _close_text(self) -> list[bytes]:
        item = self.text_item
        if item is None:
            return []
        self.text_item = None
        index = self.output.index(item)
        part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
        item.update(status=self._item_status(), content=[part])
        return [
            self.event(
                "response.output_text.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                text=self.text,
                logprobs=[],
            ),
            self.event(
                "response.content_part.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=part,
            ),
            self.event("response.output_item.done", output_index=index, item=item),
        ]

    def _close_calls(self) -> list[bytes]:
        out = []
        for item in self.calls.values():
            if item["status"] != "in_progress":
                continue
            index = self.output.index(item)
            item["status"] = self._item_status()
            out.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
            out.append(self.event("response.output_item.done", output_index=index, item=item))
        return out

    def done(self) -> list[bytes]:
        """The end of a stream that finished: open items close, then the Response."""
        out = self._close_text() + self._close_calls()
        if not self.output:  # an empty answer is still one message
            self.text_item = message_item(new_id("msg"), "", "in_progress")
            self.output.append(self.text_item)
            out.append(
                self.event("response.output_item.added", output_index=0, item=self.text_item)
            )
            out += self._close_text()
        self.final = self.turn.finished(self.output, self.finish, self.usage)
        kind = (
            "response.incomplete" if self.final["status"] == "incomplete" else "response.completed"
        )
        out.append(self.event(kind, response=self.final))
        return out

    def failed(self, error: dict[str, Any]) -> list[bytes]:
        """The stream broke off: an ``error`` event, then ``response.failed``."""
        message = str(error.get("message") or "the generation failed")
        code = error.get("code") or error.get("type")
        return [
            self.event("error", code=code, message=message, param=error.get("param")),
            self.event(
                "response.failed",
                response=self.turn.response(
                    "failed",
                    self.output,
                    usage_of(self.usage),
                    error={"code": "server_error", "message": message},
                ),
            ),
        ]
