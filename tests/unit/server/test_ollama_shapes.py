"""The pure Ollama <-> OpenAI translation (options, format, messages, tool calls) and the
model views (tags, show, ps)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from bundled_models import SMOLLM2_INFO
from server_fakes import spec

from elbowroom.errors import BadRequest, InsufficientMemory
from elbowroom.models.spec import Holding, ModelKind, ModelSpec
from elbowroom.server.http.ollama_paths import error_body, strip_tag
from elbowroom.server.ollama import models as views
from elbowroom.server.ollama import shapes
from elbowroom.server.openai.schemas import ChatCompletionRequest


def test_options_map_onto_openai_fields() -> None:
    fields, num_ctx = shapes.options_to_openai(
        {
            "temperature": 0.2,
            "top_p": 0.9,
            "seed": 7,
            "stop": ["\n"],
            "num_predict": 12,
            "num_ctx": 2048,
            "num_thread": 8,
            "num_gpu": 99,
            "use_mmap": True,
        }
    )
    assert fields == {"temperature": 0.2, "top_p": 0.9, "seed": 7, "stop": ["\n"], "max_tokens": 12}
    assert num_ctx == 2048
    # Ollama's "no limit" values leave max_tokens to the server's cap.
    assert shapes.options_to_openai({"num_predict": -1})[0] == {"max_tokens": None}
    assert shapes.options_to_openai({"num_predict": -2})[0] == {"max_tokens": None}


def test_llama_samplers_pass_through() -> None:
    """Users' Modelfile-style options (they were a 400 before): llama.cpp's samplers under
    their own names, validated by the OpenAI schema and sent to the engine."""
    options = {
        "top_k": 40,
        "min_p": 0.05,
        "typical_p": 0.9,
        "repeat_penalty": 1.1,
        "repeat_last_n": 64,
        "mirostat": 2,
        "mirostat_tau": 5.0,
        "mirostat_eta": 0.1,
    }
    fields, _ = shapes.options_to_openai(options)
    assert fields == options
    request = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    )
    assert request.to_engine(8).samplers == options
    with pytest.raises(ValueError, match="mirostat"):
        ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "mirostat": 3}
        )


@pytest.mark.parametrize(
    ("options", "param", "words"),
    [
        ({"tfs_z": 0.9}, "tfs_z", "not supported"),
        ({"penalize_newline": True}, "penalize_newline", "not supported"),
        ({"num_predict": 0}, "num_predict", "-1 for no limit"),
        ({"num_predict": "5"}, "num_predict", "integer"),
        ({"num_ctx": 0}, "num_ctx", "positive"),
        ({"bogus": 1}, "bogus", "not an Ollama option"),
    ],
)
def test_options_that_cannot_be_honoured_are_400(
    options: dict[str, object], param: str, words: str
) -> None:
    with pytest.raises(BadRequest) as info:
        shapes.options_to_openai(options)
    assert info.value.param == param and words in info.value.message


def test_format_json_and_schema() -> None:
    assert shapes.response_format(None) is None and shapes.response_format("") is None
    assert shapes.response_format("json") == {"type": "json_object"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert shapes.response_format(schema) == {
        "type": "json_schema",
        "json_schema": {"name": "format", "schema": schema},
    }
    with pytest.raises(BadRequest):
        shapes.response_format("yaml")


def test_chat_translation_carries_tools_and_tool_results() -> None:
    body = shapes.ChatBody.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": "weather in Paris?"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"function": {"name": "weather", "arguments": {"city": "Paris"}}}
                    ],
                },
                {"role": "tool", "content": "20 C", "tool_name": "weather"},
            ],
            "tools": [{"type": "function", "function": {"name": "weather"}}],
            "format": "json",
            "options": {"temperature": 0},
        }
    )
    out = shapes.chat_to_openai(body)
    assert out["response_format"] == {"type": "json_object"} and out["temperature"] == 0
    assert out["tools"] == [{"type": "function", "function": {"name": "weather"}}]
    call = out["messages"][1]["tool_calls"][0]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert out["messages"][2]["tool_call_id"] == call["id"]


def test_images_become_image_parts() -> None:
    chat = shapes.ChatBody.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "?", "images": ["aGk="]}]}
    )
    content = shapes.chat_to_openai(chat)["messages"][0]["content"]
    # The media type is set by server/openai/images.py once the bytes are checked.
    assert content == [
        {"type": "text", "text": "?"},
        {"type": "image_url", "image_url": {"url": "data:image/*;base64,aGk="}},
    ]
    gen = shapes.GenerateBody.model_validate({"model": "m", "prompt": "", "images": ["aGk="]})
    kind, out = shapes.generate_to_openai(gen)
    assert kind == "chat" and out["messages"][0]["content"][0]["type"] == "image_url"
    with pytest.raises(BadRequest) as info:
        shapes.chat_to_openai(
            shapes.ChatBody.model_validate(
                {"model": "m", "messages": [{"role": "user", "content": "?", "images": [3]}]}
            )
        )
    assert info.value.param == "images"


def test_unsupported_generate_fields_are_400() -> None:
    for extra in (
        {"images": ["aGk="], "raw": True},
        {"template": "{{ .Prompt }}"},
        {"context": [1, 2]},
        {"suffix": "end"},
        {"think": True},
    ):
        body = shapes.GenerateBody.model_validate({"model": "m", "prompt": "hi", **extra})
        with pytest.raises(BadRequest):
            shapes.generate_to_openai(body)


def test_generate_uses_the_chat_template_unless_raw() -> None:
    body = shapes.GenerateBody.model_validate({"model": "m", "prompt": "hi", "system": "be brief"})
    kind, out = shapes.generate_to_openai(body)
    assert kind == "chat"
    assert out["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    raw = shapes.GenerateBody.model_validate({"model": "m", "prompt": "1, 2,", "raw": True})
    assert shapes.generate_to_openai(raw) == ("completion", {"model": "m", "prompt": "1, 2,"})


def test_responses_tool_calls_durations_and_errors() -> None:
    calls = shapes.tool_calls_to_ollama(
        [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
            }
        ]
    )
    assert calls == [
        {
            "id": "call_1",
            "function": {"index": 0, "name": "weather", "arguments": {"city": "Paris"}},
        }
    ]
    d = shapes.durations(
        {
            "usage": {"prompt_tokens": 5, "completion_tokens": 3},
            "timings": {"prompt_ms": 2.5, "predicted_ms": 10},
        },
        50_000_000,
        1000,
    )
    assert d == {
        "total_duration": 50_000_000,
        "load_duration": 1000,
        "prompt_eval_count": 5,
        "prompt_eval_duration": 2_500_000,
        "eval_count": 3,
        "eval_duration": 10_000_000,
    }
    err = InsufficientMemory("does not fit", details={"needed": 10, "available": 4})
    assert error_body(err) == {"error": "does not fit", "needed": 10, "available": 4}
    assert shapes.done_reason("length") == "length" and shapes.done_reason("tool_calls") == "stop"
    assert strip_tag("smollm2-135m:latest") == "smollm2-135m"
    assert strip_tag("a:b") == "a:b"


def test_model_views_from_gguf_metadata(tmp_path: Path) -> None:
    weights = tmp_path / "m.gguf"
    weights.write_bytes(b"GGUF")
    info = replace(
        SMOLLM2_INFO, name="Tiny", trained_ctx=2048, file_type="Q8_0", n_params=134_515_008
    )
    llm = ModelSpec("tiny", ModelKind.LLM, "llama", weights, 4, Holding.MMAP, "path", gguf=info)
    tag = views.tag(llm)
    assert tag["name"] == tag["model"] == "tiny:latest" and len(tag["digest"]) == 64
    assert tag["details"]["parameter_size"] == "135M"
    assert tag["details"]["quantization_level"] == "Q8_0" and tag["details"]["format"] == "gguf"
    shown = views.show(llm)
    assert shown["model_info"]["llama.context_length"] == 2048
    assert shown["capabilities"] == ["completion", "tools"]
    assert views.capabilities(spec("e", ModelKind.EMBEDDING, "onnx-embed")) == ["embedding"]
    row = {"id": "tiny", "bytes": 100, "gpu": 30, "n_ctx": 1024, "expires_at": None}
    entry = views.ps_entry(llm, row, 1_700_000_000.0)
    assert entry["size"] == 130 and entry["size_vram"] == 30 and entry["context_length"] == 1024
    assert entry["expires_at"].startswith("2316") and entry["keep_alive_expires"] is None
    row["expires_at"] = "2026-01-01T00:00:00+00:00"
    assert views.ps_entry(llm, row, 0)["expires_at"] == "2026-01-01T00:00:00Z"


def test_tool_results_match_by_call_id_or_name_or_order() -> None:
    """ChatOllama sends a result's tool_call_id (the id it was given, while the assistant's
    call it repeats carries none), litellm's ollama_chat/ sends ``name``: each result answers
    one open call, in order, and the request passes the OpenAI schema's pairing check (it
    answered 400 "messages[2] answers tool_call_id 'call_2'" before)."""
    fn = {"function": {"name": "weather", "arguments": {"city": "Paris"}}}
    cases = [
        ([{"id": "a", **fn}, {"id": "b", **fn}], [{"tool_call_id": "b"}, {"tool_call_id": "a"}]),
        ([fn, fn], [{"tool_call_id": "from-the-answer"}, {"tool_call_id": "other"}]),
        ([fn, fn], [{"name": "weather"}, {"name": "weather"}]),
        ([fn, fn], [{"tool_name": "weather"}, {"tool_name": "weather"}]),
        ([fn, fn], [{}, {}]),
    ]
    for calls, results in cases:
        body = shapes.ChatBody.model_validate(
            {
                "model": "m",
                "messages": [
                    {"role": "user", "content": "weather in Paris and Rome?"},
                    {"role": "assistant", "content": "", "tool_calls": calls},
                    *({"role": "tool", "content": "20 C", **r} for r in results),
                ],
            }
        )
        out = shapes.chat_to_openai(body)
        ids = [c["id"] for c in out["messages"][1]["tool_calls"]]
        answered = [m["tool_call_id"] for m in out["messages"][2:]]
        assert sorted(answered) == sorted(ids), (results, answered, ids)
        if results[0].get("tool_call_id") == "b":
            assert answered == ["b", "a"]
        ChatCompletionRequest.model_validate(out)  # no 400: every result answers a call
