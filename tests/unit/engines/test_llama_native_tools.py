"""Tools on a model whose chat template handles them natively, on the real engine.

llama.cpp compiles such a template's tool grammar as GBNF, and GBNF is where a costly
schema (a ``pattern``, length/count bounds, a ``format``: engines/llama_grammar.py) held the
engine's loop for every slot. A tool with costly ``parameters`` is therefore emulated even
on such a model, its call schema sent as an llguidance grammar; other tools stay native.
The model is the bundled SmolLM2 with a Hermes/Qwen-style tools template written into a
copy of its GGUF (tests/crafted_gguf.py)."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from bundled_models import bundled_spec
from crafted_gguf import with_chat_template
from engine_text import engine_run

from elbowroom.engines.llama import LlamaEngine
from elbowroom.engines.options import LlamaOptions
from elbowroom.engines.requests import TextRequest

pytestmark = pytest.mark.slow

# Qwen2.5's tools template, reduced to what SmolLM2's ChatML tokens need.
TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nYou are a helpful assistant.\\n\\n# Tools\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\\n'
    "</tool_call><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}"
    '{%- endif %}{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}'
    '{{- \'", "arguments": \' }}{{- tool_call.arguments | tojson }}'
    "{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + "
    "'\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + "
    "'<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Inside every schema bound; as GBNF ``^((a?){0,32}){0,32}$`` alone held the loop 16 s.
NESTED = "^(((a?){0,1024}){0,1024}){0,1024}$"
DEADLINE = 300.0  # generous: a busy shared machine, two slots on two cores
ASK = ({"role": "user", "content": "What is the weather in Paris?"},)


def weather_tool(city: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": city},
                "required": ["city"],
            },
        },
    }


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaEngine]:
    source = bundled_spec("smollm2-135m")
    path = with_chat_template(
        source.path, tmp_path_factory.mktemp("native-tools") / "tools.gguf", TOOLS_TEMPLATE
    )
    eng = LlamaEngine(lambda: 0)
    options = LlamaOptions(n_ctx=1024, slots=2, cache_ram_bytes=32 << 20, threads=2)
    facts = eng.load(replace(source, path=path), options)
    assert facts["chat_template"] is True and facts["native_tools"] is True
    yield eng
    eng.close()


def emulated(eng: LlamaEngine) -> int:
    return int(eng.stats()["socket_streams"]["emulated_tools"])


def run_in_thread(eng: LlamaEngine, request: TextRequest) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(engine_run(eng, request)[0])
        except Exception as exc:  # surfaced by the test's assertion
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def wait_until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_a_costly_tool_schema_is_emulated_and_stalls_no_other_slot(engine: LlamaEngine) -> None:
    """The tool's ``pattern`` goes to the engine as llguidance (the call is emulated): the
    call follows it, and a small chat in the other slot meanwhile finishes. Natively (GBNF)
    the template's grammar was not even applied to this request: prose came back for
    ``tool_choice: "required"``."""
    before = emulated(engine)
    tool = weather_tool({"type": "string", "pattern": NESTED})
    costly = TextRequest(
        kind="chat",
        max_tokens=64,
        messages=ASK,
        tools=(tool,),
        tool_choice="required",
        temperature=0.0,
    )
    costly_thread, costly_out = run_in_thread(engine, costly)
    wait_until(lambda: emulated(engine) > before or costly_out, "the costly request to open")
    small = TextRequest(kind="chat", max_tokens=2, messages=({"role": "user", "content": "Hi"},))
    small_thread, small_out = run_in_thread(engine, small)
    small_thread.join(DEADLINE)
    assert small_out and isinstance(small_out[0], dict), small_out
    assert small_out[0]["finish_reason"] in ("length", "stop")
    costly_thread.join(DEADLINE)
    assert costly_out and isinstance(costly_out[0], dict), costly_out
    assert emulated(engine) == before + 1
    calls = costly_out[0].get("tool_calls") or []
    assert [c["function"]["name"] for c in calls] == ["get_weather"], costly_out[0]
    city = json.loads(calls[0]["function"]["arguments"])["city"]
    assert re.fullmatch(NESTED, city), city


def test_a_cheap_tool_schema_stays_native(engine: LlamaEngine) -> None:
    before = emulated(engine)
    request = TextRequest(
        kind="chat",
        max_tokens=8,
        messages=ASK,
        tools=(weather_tool({"type": "string"}),),
        temperature=0.0,
    )
    engine_run(engine, request)
    assert emulated(engine) == before
