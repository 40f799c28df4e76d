"""PURE: Ollama's request and response bodies, and their translation to and from the OpenAI
request fields every text request is served with.

An Ollama request becomes an OpenAI chat or completion request (a dict the OpenAI routes'
schemas validate), so both APIs reach the engine through the same path and the same checks.
Ollama ``options`` map onto OpenAI fields where one exists; options that only tune how a
model is loaded (threads, GPU layers, mmap) are elbowroom's to decide and have no effect;
sampling options the engine cannot honour are a 400 that names them. docs/api.md lists them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from elbowroom.errors import BadRequest

# The Ollama API version whose shapes these follow (clients gate features on it: tools,
# structured outputs and /api/embed all exist from here on).
OLLAMA_API_VERSION = "0.13.0"

_LAX = ConfigDict(extra="ignore")

# Ollama option -> the OpenAI field that carries it (the engine honours these).
_OPENAI_OPTIONS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "seed": "seed",
    "stop": "stop",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    # llama.cpp's samplers, under the same names on /v1 (server/schemas.SAMPLERS)
    "top_k": "top_k",
    "min_p": "min_p",
    "typical_p": "typical_p",
    "repeat_penalty": "repeat_penalty",
    "repeat_last_n": "repeat_last_n",
    "mirostat": "mirostat",
    "mirostat_tau": "mirostat_tau",
    "mirostat_eta": "mirostat_eta",
}
# How a model is loaded and run, which elbowroom decides from its memory budget: accepted
# (clients send them by habit) and without effect.
NO_EFFECT_OPTIONS = frozenset(
    {
        "numa",
        "num_batch",
        "num_gpu",
        "main_gpu",
        "low_vram",
        "f16_kv",
        "logits_all",
        "vocab_only",
        "use_mmap",
        "use_mlock",
        "embedding_only",
        "num_thread",
        "num_keep",
    }
)
# Sampling options that would change the output and that the engine does not take (llama.cpp
# dropped both samplers).
UNSUPPORTED_OPTIONS = frozenset({"tfs_z", "penalize_newline"})


# --- requests ---------------------------------------------------------------------------


class Message(BaseModel):
    model_config = _LAX
    role: str
    content: str | None = ""
    images: list[Any] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None
    # Not Ollama's own, but what its clients send on a tool result (ChatOllama, litellm's
    # ollama_chat/): the call id, or the tool's name under OpenAI's key.
    tool_call_id: str | None = None
    name: str | None = None
    thinking: str | None = None


class _Common(BaseModel):
    model_config = _LAX
    model: str = Field(min_length=1)
    stream: bool = True  # Ollama streams unless told not to
    format: str | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    keep_alive: int | float | str | None = None
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class ChatBody(_Common):
    messages: list[Message] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class GenerateBody(_Common):
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool | None = None
    images: list[Any] | None = None


class EmbedBody(BaseModel):
    model_config = _LAX
    model: str = Field(min_length=1)
    input: Any = None
    truncate: bool | None = None
    options: dict[str, Any] | None = None
    keep_alive: int | float | str | None = None
    dimensions: int | None = None


class EmbeddingsBody(BaseModel):
    model_config = _LAX
    model: str = Field(min_length=1)
    prompt: str | None = None
    options: dict[str, Any] | None = None
    keep_alive: int | float | str | None = None


class ShowBody(BaseModel):
    model_config = _LAX
    model: str | None = None
    name: str | None = None  # the older field name
    verbose: bool | None = None

    def model_name(self) -> str:
        name = self.model or self.name
        if not name:
            raise BadRequest("Missing required parameter: 'model'", param="model")
        return name


# --- request translation ----------------------------------------------------------------


def options_to_openai(options: Mapping[str, Any] | None) -> tuple[dict[str, Any], int | None]:
    """OpenAI fields for Ollama ``options``, and the ``num_ctx`` asked for (checked by the
    route against the context the model was given)."""
    fields: dict[str, Any] = {}
    num_ctx: int | None = None
    for key, value in (options or {}).items():
        if value is None or key in NO_EFFECT_OPTIONS:
            continue
        if key in _OPENAI_OPTIONS:
            fields[_OPENAI_OPTIONS[key]] = value
        elif key == "num_predict":
            fields["max_tokens"] = _num_predict(value)
        elif key == "num_ctx":
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise BadRequest("options.num_ctx must be a positive integer", param="num_ctx")
            num_ctx = value
        elif key in UNSUPPORTED_OPTIONS:
            raise BadRequest(
                f"options.{key} is not supported by elbowroom's engine (llama.cpp dropped that "
                "sampler); remove it (supported: num_predict, num_ctx, "
                + ", ".join(_OPENAI_OPTIONS)
                + ")",
                param=key,
                code="unsupported_option",
            )
        else:
            raise BadRequest(f"options.{key} is not an Ollama option", param=key)
    return fields, num_ctx


def _num_predict(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest("options.num_predict must be an integer", param="num_predict")
    if value in (-1, -2):  # Ollama: no limit / fill the context
        return None
    if value < 1:
        raise BadRequest(
            f"options.num_predict={value}: use a positive number of tokens, or -1 for no limit",
            param="num_predict",
        )
    return value


def response_format(fmt: str | dict[str, Any] | None) -> dict[str, Any] | None:
    """Ollama ``format`` ("json" or a JSON schema) as OpenAI's ``response_format``."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    raise BadRequest(
        f'format {fmt!r} is not supported: send "json" or a JSON schema object', param="format"
    )


def _with_images(text: str, images: list[Any] | None, where: str) -> str | list[dict[str, Any]]:
    """A message's content with Ollama's ``images`` (base64, no data: prefix) as OpenAI
    image parts; server/openai/images.py checks them and sets the media type it finds."""
    if not images:
        return text
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    for k, image in enumerate(images):
        if not isinstance(image, str):
            raise BadRequest(
                f"{where}[{k}] must be a base64 string", param="images", code="invalid_image"
            )
        url = image if image.startswith("data:") else f"data:image/*;base64,{image}"
        parts.append({"type": "image_url", "image_url": {"url": url}})
    return parts


def _common_fields(body: _Common) -> dict[str, Any]:
    if body.think not in (None, False, "false"):
        raise BadRequest(
            f"think={body.think!r}: model {body.model!r} does not support thinking; leave "
            "think out or set it to false",
            param="think",
        )
    fields, _ = options_to_openai(body.options)
    fmt = response_format(body.format)
    if fmt is not None:
        fields["response_format"] = fmt
    if body.logprobs:
        fields["logprobs"] = True
        if body.top_logprobs:
            fields["top_logprobs"] = body.top_logprobs
    return {"model": body.model, **fields}


def chat_to_openai(body: ChatBody) -> dict[str, Any]:
    """The OpenAI chat request for an Ollama /api/chat request with messages.

    Ollama itself does not pair a tool result with its call; the OpenAI schema does, so a
    result is matched to the call it answers: by its ``tool_call_id`` when an earlier call
    has that id, else by the tool's name (``tool_name``, or ``name``) among the calls not
    yet answered, else to the first call not yet answered. Calls without an id get
    ``call_{message}_{index}``."""
    messages: list[dict[str, Any]] = []
    open_calls: list[tuple[str, str]] = []  # (id, tool name) of calls with no result yet
    for i, m in enumerate(body.messages):
        content = _with_images(m.content or "", m.images, f"messages[{i}].images")
        out: dict[str, Any] = {"role": m.role, "content": content}
        if m.tool_calls:
            out["tool_calls"] = []
            for j, call in enumerate(m.tool_calls):
                fn = call.get("function") or {}
                name = str(fn.get("name", ""))
                call_id = str(call.get("id") or f"call_{i}_{j}")
                open_calls.append((call_id, name))
                args = fn.get("arguments", {})
                out["tool_calls"].append(
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {
                            "name": name,
                            "arguments": args if isinstance(args, str) else json.dumps(args),
                        },
                    }
                )
        if m.role == "tool":
            name = m.tool_name or m.name or ""
            out["tool_call_id"] = _answered_call(open_calls, m.tool_call_id, name, i)
            if name:
                out["name"] = name
        messages.append(out)
    request = {**_common_fields(body), "messages": messages}
    if body.tools:
        request["tools"] = body.tools
    return request


def _answered_call(
    open_calls: list[tuple[str, str]], call_id: str | None, name: str, i: int
) -> str:
    """The id of the call a tool result answers (taken off ``open_calls``)."""
    for match in (
        lambda c: c[0] == call_id,
        lambda c: bool(name) and c[1] == name,
        lambda c: True,
    ):
        for k, call in enumerate(open_calls):
            if match(call):
                del open_calls[k]
                return call[0]
    # No call to answer: the schema's check names the problem.
    return call_id or f"call_{name or i}"


def generate_to_openai(body: GenerateBody) -> tuple[Literal["chat", "completion"], dict[str, Any]]:
    """Ollama /api/generate as an OpenAI request: the prompt goes through the model's chat
    template (as Ollama does) unless ``raw``, which sends it as it is."""
    if body.images and body.raw:
        raise BadRequest(
            "raw mode does not support images: leave raw out so the model's chat template "
            "places them",
            param="images",
        )
    if body.template:
        raise BadRequest(
            "template is not supported: elbowroom renders prompts with the model's own chat "
            "template; send raw=true to pass a prompt you formatted yourself",
            param="template",
        )
    if body.context:
        raise BadRequest(
            "context (the token list of an earlier answer) is not supported; send the "
            "conversation as messages to /api/chat",
            param="context",
        )
    if body.suffix:
        raise BadRequest("suffix (fill-in-the-middle) is not supported", param="suffix")
    fields = _common_fields(body)
    prompt = body.prompt or ""
    if body.raw:
        if body.system:
            raise BadRequest("raw mode does not support system", param="system")
        if body.logprobs:
            raise BadRequest("raw mode does not support logprobs", param="logprobs")
        return "completion", {**fields, "prompt": prompt}
    messages: list[dict[str, Any]] = (
        [{"role": "system", "content": body.system}] if body.system else []
    )
    messages.append({"role": "user", "content": _with_images(prompt, body.images, "images")})
    return "chat", {**fields, "messages": messages}


# --- responses --------------------------------------------------------------------------


def now_iso() -> str:
    return datetime.now(tz=UTC).isoformat().replace("+00:00", "Z")


def iso_at(wall: float) -> str:
    return datetime.fromtimestamp(wall, tz=UTC).isoformat().replace("+00:00", "Z")


def tool_calls_to_ollama(calls: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """OpenAI tool calls (arguments as a JSON string) as Ollama's (arguments as an object)."""
    out = []
    for i, call in enumerate(calls or ()):
        fn = call.get("function") or {}
        raw = fn.get("arguments") or "{}"
        try:
            args = json.loads(raw) if isinstance(raw, str) else raw
        except ValueError:
            args = {}
        entry: dict[str, Any] = {
            "function": {
                "index": i,
                "name": fn.get("name", ""),
                "arguments": args if isinstance(args, dict) else {},
            }
        }
        if call.get("id"):
            entry["id"] = call["id"]
        out.append(entry)
    return out


def logprobs_to_ollama(entries: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    return [
        {
            "token": e.get("token", ""),
            "logprob": e.get("logprob", 0.0),
            **(
                {
                    "top_logprobs": [
                        {"token": t.get("token", ""), "logprob": t.get("logprob", 0.0)}
                        for t in e["top_logprobs"]
                    ]
                }
                if e.get("top_logprobs")
                else {}
            ),
        }
        for e in entries or ()
    ]


def durations(result: Mapping[str, Any], total_ns: int, load_ns: int) -> dict[str, Any]:
    """Ollama's counts and durations (nanoseconds) from the engine's usage and timings."""
    usage = result.get("usage") or {}
    timings = result.get("timings") or {}
    return {
        "total_duration": total_ns,
        "load_duration": load_ns,
        "prompt_eval_count": int(usage.get("prompt_tokens", 0)),
        "prompt_eval_duration": int(float(timings.get("prompt_ms", 0)) * 1e6),
        "eval_count": int(usage.get("completion_tokens", 0)),
        "eval_duration": int(float(timings.get("predicted_ms", 0)) * 1e6),
    }


def done_reason(finish_reason: Any) -> str:
    return "length" if finish_reason == "length" else "stop"
