"""The LLM engine's pure parts: tool-call emulation, slot choice (the events' assembly is
the relay's: tests/unit/server/test_relay.py)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, cast

import pytest

from elbowroom.engines.llama_control import EngineControl
from elbowroom.engines.llama_slots import (
    MAX_KEY_CHARS,
    MIN_WAIT_CHARS,
    SEQ_MAGIC,
    Holder,
    Slots,
    is_slot_state,
)
from elbowroom.engines.llama_tools import parse, plan
from elbowroom.errors import BadRequest
from elbowroom.kvcache import CacheKey, PrefixCache
from elbowroom.units import MiB

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def _messages() -> list[dict[str, Any]]:
    return [{"role": "user", "content": "Weather in Oslo?"}]


def test_native_templates_get_the_tools_and_a_named_choice_becomes_required() -> None:
    body = {"messages": _messages(), "tools": [WEATHER, TIME], "tool_choice": "auto"}
    p = plan(body, native=True)
    assert not p.emulated and p.body["tools"] == [WEATHER, TIME]
    named = {"type": "function", "function": {"name": "get_time"}}
    p = plan({**body, "tool_choice": named}, native=True)
    assert p.body["tools"] == [TIME] and p.body["tool_choice"] == "required"


def test_emulated_required_constrains_the_output_to_a_call_object() -> None:
    p = plan({"messages": _messages(), "tools": [WEATHER], "tool_choice": "required"}, False)
    assert p.emulated and "tools" not in p.body
    schema = p.body["response_format"]["json_schema"]["schema"]
    assert schema["properties"]["name"] == {"const": "get_weather"}
    assert schema["properties"]["arguments"] == WEATHER["function"]["parameters"]
    system = p.body["messages"][0]
    assert system["role"] == "system" and "get_weather" in system["content"]


def test_emulated_auto_allows_a_plain_answer_and_none_drops_the_tools() -> None:
    p = plan({"messages": _messages(), "tools": [WEATHER, TIME]}, False)
    variants = p.body["response_format"]["json_schema"]["schema"]["anyOf"]
    assert len(variants) == 3 and "content" in variants[-1]["properties"]
    p = plan({"messages": _messages(), "tools": [WEATHER], "tool_choice": "none"}, False)
    assert not p.emulated and "response_format" not in p.body and "tools" not in p.body


def test_nested_models_in_tool_parameters_are_inlined_for_both_paths() -> None:
    """instructor's default mode sends a pydantic model with a nested one as a tool whose
    parameters carry ``$defs``; nested inside the call object, ``#/$defs/City`` resolved
    nowhere and llama.cpp refused the request (a 400 for every nested model)."""
    city = {"type": "object", "properties": {"name": {"type": "string"}}}
    params = {
        "$defs": {"City": city},
        "type": "object",
        "properties": {"cities": {"type": "array", "items": {"$ref": "#/$defs/City"}}},
    }
    tool = {"type": "function", "function": {"name": "Country", "parameters": params}}
    want = {"type": "object", "properties": {"cities": {"type": "array", "items": city}}}
    native = plan({"messages": _messages(), "tools": [tool]}, native=True)
    assert native.body["tools"][0]["function"]["parameters"] == want
    emulated = plan({"messages": _messages(), "tools": [tool], "tool_choice": "required"}, False)
    schema = emulated.body["response_format"]["json_schema"]["schema"]
    assert schema["properties"]["arguments"] == want
    # A recursive model cannot be inlined: it is sent as it came.
    node = {"type": "object", "properties": {"kids": {"items": {"$ref": "#/$defs/Node"}}}}
    recursive = {**params, "$defs": {"Node": node}, "properties": {"n": {"$ref": "#/$defs/Node"}}}
    rtool = {"type": "function", "function": {"name": "Tree", "parameters": recursive}}
    assert plan({"messages": _messages(), "tools": [rtool]}, True).body["tools"] == [rtool]


def test_a_named_choice_missing_from_tools_is_a_bad_request() -> None:
    choice = {"type": "function", "function": {"name": "nope"}}
    with pytest.raises(BadRequest):
        plan({"messages": _messages(), "tools": [WEATHER], "tool_choice": choice}, False)


def test_earlier_tool_turns_become_text_for_templates_without_tools() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    msgs = [
        *_messages(),
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    p = plan({"messages": msgs, "tools": [WEATHER], "tool_choice": "required"}, False)
    assert p.body["messages"][2]["role"] == "assistant"
    assert json.loads(p.body["messages"][2]["content"])["name"] == "get_weather"
    assert p.body["messages"][3] == {"role": "user", "content": "Tool result: sunny"}


def test_parse_turns_emulated_replies_into_calls_or_content() -> None:
    content, calls = parse('{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    assert content == "" and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert calls[0]["id"].startswith("call_")
    assert parse('{"content": "Hello"}') == ("Hello", [])
    assert parse('{"name": "get_wea') == ('{"name": "get_wea', [])  # cut short: no call


class _NoControl:
    def request(self, *a: Any, **k: Any) -> Any:
        raise AssertionError("slot choice needs no engine call")


def test_a_conversation_keeps_its_slot_and_strangers_take_the_least_recent() -> None:
    control = cast(EngineControl, _NoControl())
    slots = Slots(control, 3, None, save_dir=Path("/nonexistent"), block_tokens=64)
    story = "system: You are a storyteller who knows many old tales. " * 3
    a = slots.acquire(story + "user: once upon")
    slots.release(a)
    b = slots.acquire("user: hi")  # shares nothing: another slot
    assert b != a
    slots.release(b)
    c = slots.acquire("user: what is 2+2")  # shares "user: " with b only: not enough
    assert c not in (a, b)
    slots.release(c)
    again = slots.acquire(story + "user: once upon a time")  # continues a's conversation
    assert again == a
    busy = slots.acquire(story + "user: once upon a time there")  # a is busy now
    assert busy != a


def test_a_prompt_whose_slot_is_busy_waits_for_it_rather_than_recomputing() -> None:
    """Issue 21's dropped stream: the only copy of a long prompt is in a slot whose stream
    still runs (or whose close is a moment late); the next request with that prefix waits
    for that slot (it got another slot and prefilled all of it again before). A slot that
    does not come free within the prefill's estimated time is not waited for longer."""
    control = cast(EngineControl, _NoControl())
    slots = Slots(control, 3, None, save_dir=Path("/nonexistent"), block_tokens=64)
    prefix = "system: " + "".join(f"Rule {i}: check shelf {i % 17}.\n" for i in range(200))
    first = slots.acquire(prefix + "user: question one")
    other = slots.acquire("user: an unrelated request")
    slots.release(other)
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(slots.acquire(prefix + "user: two")))
    waiter.start()
    deadline = time.monotonic() + 30
    while slots.prefix_waits < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert slots.prefix_waits == 1 and not got  # waiting, though two slots are free
    slots.release(first)
    waiter.join(30)
    assert got == [first]
    # The slot stays busy: after the estimated recompute time, another slot is taken.
    slots.observe_prefill({"prompt_n": 100_000, "prompt_ms": 1000.0})  # ~0.02 s to recompute
    elsewhere = slots.acquire(prefix + "user: three")
    assert elsewhere != first and slots.prefix_waits == 2


def _preempting(rules: int) -> tuple[Slots, list[int], int, str, list[int], threading.Thread]:
    """Three slots at 100 prefill tokens/s: a stream holds a ``rules``-line prefix on one
    and a second request for that prefix has asked to preempt it (it waits for the slot).
    Returns the slots, the slots asked for, the preempted slot, the prefix, and the waiting
    request's result list and thread."""
    control = cast(EngineControl, _NoControl())
    slots = Slots(control, 3, None, save_dir=Path("/nonexistent"), block_tokens=64)
    asked: list[int] = []
    slots.holder = lambda slot, preempt: (asked.append(slot), Holder.PREEMPTED)[1]
    slots.may_preempt = True
    slots.observe_prefill({"prompt_n": 1000, "prompt_ms": 10_000.0})  # 100 tokens/s
    prefix = "system: " + "".join(f"Rule {i}: check shelf {i % 17}.\n" for i in range(rules))
    first = slots.acquire(prefix + "user: question one")
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(slots.acquire(prefix + "user: two")))
    waiter.start()
    deadline = time.monotonic() + 30
    while not asked and time.monotonic() < deadline:
        time.sleep(0.01)
    return slots, asked, first, prefix, got, waiter


def test_a_busy_slot_holding_a_long_prefix_is_preempted_and_claimed() -> None:
    """Preempt and resume (server/stream/resume.py): the slot whose stream holds the prefix is
    preempted at once (no wait for its answer to end), claimed for the request that needs
    it — the preempted stream's continuation, arriving meanwhile, takes another slot — and
    the continuation itself never waits nor preempts. A slot whose holder cannot be
    preempted is waited for as before."""
    slots, asked, first, prefix, got, waiter = _preempting(200)
    assert asked == [first] and slots.preemptions == 1 and not got
    # The preempted stream gives its slot back and its continuation (which shares the most
    # with that slot) asks for one: the claimed slot is not for it, and it does not wait.
    with slots._lock:  # the release and the continuation's acquire before the waiter wakes
        slots._free.add(first)
    resumed = slots.acquire(prefix + "user: question one. The answer", resumed=True)
    assert resumed != first
    slots.release(first)
    waiter.join(30)
    assert got == [first] and slots.preemptions == 1
    # A holder that cannot be preempted: waited for, no preemption counted.
    slots.holder = lambda slot, preempt: Holder.KEPT
    third: list[int] = []
    again = threading.Thread(target=lambda: third.append(slots.acquire(prefix + "user: 3")))
    again.start()
    deadline = time.monotonic() + 30
    while slots.prefix_waits < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not third and slots.preemptions == 1
    slots.release(first)
    again.join(30)
    assert third == [first]


def test_a_slot_still_prefilling_the_prefix_is_waited_for_past_the_recompute_estimate() -> None:
    """Issue 24's arena: four requests for one model's shared system prompt each recomputed
    it side by side — the three later ones waited the recompute estimate (~10 s) for the
    slot prefilling it, which on two busy cores took 14 s, then gave up. While the holder
    is not past its prefill the wait goes on (it is asked every HOLDER_POLL_S); once it
    generates it is preempted. Without preemption, a holder that turns to generating is
    waited for one more recompute estimate, then the request recomputes elsewhere."""
    control = cast(EngineControl, _NoControl())
    slots = Slots(control, 3, None, save_dir=Path("/nonexistent"), block_tokens=64)
    slots.observe_prefill({"prompt_n": 100_000, "prompt_ms": 1000.0})  # ~0.02 s estimate
    prefix = "system: " + "".join(f"Rule {i}: check shelf {i % 17}.\n" for i in range(200))
    first = slots.acquire(prefix + "user: question one")
    phase = [Holder.PREFILLING]
    asked: list[tuple[int, bool]] = []

    def holder(slot: int, preempt: bool) -> Holder:
        asked.append((slot, preempt))
        return phase[0]

    slots.holder = holder
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(slots.acquire(prefix + "user: two")))
    waiter.start()
    deadline = time.monotonic() + 30
    while len(asked) < 4 and time.monotonic() < deadline:  # ~0.75 s: 40x the estimate
        time.sleep(0.01)
    assert len(asked) >= 4 and not got and {a[0] for a in asked} == {first}
    assert not any(p for _, p in asked)  # may_preempt is off: never asked to preempt
    phase[0] = Holder.KEPT  # past its prefill, not preemptible: one more estimate, then on
    waiter.join(10)
    assert got and got[0] != first and slots.prefix_waits == 1
    # With preemption (and a slow engine: worth it): asked to preempt at each ask until it
    # generates, then claimed. (A fresh pool: the recompute above left the prefix free.)
    slots = Slots(control, 3, None, save_dir=Path("/nonexistent"), block_tokens=64)
    slots.holder = holder
    slots.may_preempt = True
    slots.observe_prefill({"prompt_n": 1000, "prompt_ms": 10_000.0})  # 100 tokens/s
    first = slots.acquire(prefix + "user: question one")
    phase[0] = Holder.PREFILLING
    asked.clear()
    got.clear()
    waiter = threading.Thread(target=lambda: got.append(slots.acquire(prefix + "user: three")))
    waiter.start()
    deadline = time.monotonic() + 30
    while len(asked) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    phase[0] = Holder.PREEMPTED
    while slots.preemptions < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert slots.preemptions == 1 and not got and all(p for _, p in asked)
    slots.release(first)  # the preempted stream's relay closed
    waiter.join(10)
    assert got == [first]


def test_past_the_key_cut_a_free_slot_with_the_prefix_is_taken_without_preempting() -> None:
    """A prompt longer than the slot key's cut (MAX_KEY_CHARS) whose prefix a free slot and a
    busy slot both hold: the free one is taken at once. The free slot was measured only up
    to the cut and the busy one past it, so the busy one looked ~2,600 characters better
    (the issue's ~1,830-token prefix): it was preempted for nothing."""
    control = cast(EngineControl, _NoControl())
    slots = Slots(control, 3, None, save_dir=Path("/nonexistent"), block_tokens=64)
    prefix = "system: " + "".join(f"Rule {i}: check shelf {i % 17}.\n" for i in range(300))
    assert len(prefix) > MAX_KEY_CHARS + 2 * MIN_WAIT_CHARS
    slots.observe_prefill({"prompt_n": 100_000, "prompt_ms": 1000.0})  # ~0.02 s to recompute
    busy = slots.acquire(prefix + "user: question one")
    free = slots.acquire(prefix + "user: question two")  # waits ~0.02 s, then another slot
    slots.release(free)
    assert busy != free
    asked: list[int] = []
    slots.holder = lambda slot, preempt: (asked.append(slot), Holder.PREEMPTED)[1]
    slots.may_preempt = True
    slots._prefill_tps = 100.0  # slow now: the busy slot would be worth preempting
    waits = slots.prefix_waits
    assert slots.acquire(prefix + "user: question three") == free
    assert asked == [] and slots.prefix_waits == waits


def test_a_preempting_request_takes_its_claimed_slot_once_free() -> None:
    """The request that preempted a slot takes it as soon as it comes free, even when the
    preempted stream's continuation took another slot first and its prompt (the same long
    prefix, and more) runs past the key cut: the continuation's slot looked better and the
    request waited for it (seen in benchmarks/dropped_stream.py: the first token 8 s late)."""
    slots, asked, first, prefix, got, waiter = _preempting(300)
    assert asked == [first]
    with slots._lock:  # the release and the continuation's acquire before the waiter wakes
        slots._free.add(first)
    resumed = slots.acquire(prefix + "user: question one" + " and the answer" * 20, resumed=True)
    assert resumed != first
    slots.release(first)
    waiter.join(10)  # the preemption's wait is PREEMPT_WAIT_S (30 s)
    assert got == [first]


class _SlotsControl:
    """The engine's ``GET /slots`` at the edge: each slot's processing state and tokens
    decoded, set by the test."""

    def __init__(self, n: int) -> None:
        self.state = {s: (False, 0) for s in range(n)}
        self.gets = 0

    def request(self, method: str, path: str, body: Any) -> Any:
        assert (method, path) == ("GET", "/slots"), (method, path)
        self.gets += 1
        return [
            {"id": s, "is_processing": busy, "next_token": [{"n_decoded": n}]}
            for s, (busy, n) in self.state.items()
        ]


def _engine_on_slots(n: int) -> tuple[Any, _SlotsControl, Slots, list[dict[str, Any]]]:
    """A LlamaEngine with ``n`` slots whose engine is ``_SlotsControl`` (no process), and
    the notices it sends the server."""
    from elbowroom.engines.llama import LlamaEngine

    control = _SlotsControl(n)
    slots = Slots(cast(EngineControl, control), n, None, Path("/nonexistent"), block_tokens=64)
    engine = LlamaEngine()
    engine._control = cast(EngineControl, control)
    engine._slot_pool = slots
    notices: list[dict[str, Any]] = []
    engine.notify = notices.append
    return engine, control, slots, notices


def test_a_preempted_streams_continuation_waits_for_the_first_token_it_was_preempted_for() -> None:
    """Preempt and resume: the continuation restores its state and decodes only once the
    request that took its slot has decoded its first token (or ended): the engine runs one
    loop, so a restore and a decode step beside that request's prefill delayed its first
    token (0.72 s median against 0.54 s, benchmarks/dropped_stream.py under load), which
    is what the preemption was for. Bounded: a request that never comes is not waited for
    longer than HANDOFF_WAIT_S."""
    from elbowroom.engines import llama

    engine, control, slots, notices = _engine_on_slots(2)
    prefix = "system: " + "".join(f"Rule {i}: check shelf {i % 17}.\n" for i in range(100))
    slot = slots.acquire(prefix + "user: question one")
    engine._resumable[7] = slot
    control.state[slot] = (True, 5)  # past its prefill: preemptible
    assert engine._holder(slot, True) is Holder.PREEMPTED
    assert notices == [{"preempt": 7, "cached": 0}]
    control.state[slot] = (False, 0)  # cancelled; its state saved; the slot given back
    slots.release(slot)
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (engine._handoff(7), done.set()))
    waiter.start()
    assert not done.wait(0.3)  # nobody took the slot yet
    assert slots.acquire(prefix + "user: question two") == slot
    control.state[slot] = (True, 0)  # the request's prefill
    assert not done.wait(0.3)
    control.state[slot] = (True, 1)  # its first token
    assert done.wait(llama.HANDOFF_WAIT_S)
    waiter.join(10)
    # A continuation whose slot nobody takes waits HANDOFF_WAIT_S, then goes on.
    slots.release(slot)
    engine._resumable[8] = slot
    control.state[slot] = (True, 5)
    assert engine._holder(slot, True) is Holder.PREEMPTED
    control.state[slot] = (False, 0)
    started = time.monotonic()
    engine._handoff(8)
    assert llama.HANDOFF_WAIT_S <= time.monotonic() - started < llama.HANDOFF_WAIT_S + 10
    # No preemption recorded (a stale or unknown ticket): no wait.
    started = time.monotonic()
    engine._handoff(99)
    assert time.monotonic() - started < 1.0


def test_only_engine_slot_files_are_stored() -> None:
    good = SEQ_MAGIC.to_bytes(4, "little") + (4).to_bytes(4, "little") + b"\0" * 8
    assert is_slot_state(good)
    assert not is_slot_state(b"ELBKV\r\n\x1a" + b"\0" * 8)
    assert not is_slot_state(b"gg")


class _CountingControl:
    """The engine's control socket at the edge: records every call (a slot save is a
    ``POST /slots/N?action=save`` after a ``/tokenize``)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def request(self, method: str, path: str, body: Any = None) -> Any:
        self.calls.append(path)
        return {"tokens": list(range(1, 400))}


def test_soft_pressure_saves_no_slot_state(tmp_path: Path) -> None:
    # A chaos run (guard on) logged "saved 1 slot state(s) in 16076 ms" when pressure turned
    # soft: the save ran on the engine's loop while memory was short, and wrote the state to
    # the page cache (then read it back and stored it again) at the worst moment. Under
    # pressure the runner drops instead: the level reaches the engine, nothing is written.
    from elbowroom.engines.llama import LlamaEngine

    control = _CountingControl()
    key = CacheKey("m", 1024, "f16")
    cache = PrefixCache(key, block_tokens=64, ram_budget=0, disk_dir=tmp_path / "kv", disk_max=MiB)
    slots = Slots(cast(EngineControl, control), 2, cache, tmp_path, block_tokens=64)
    idle = slots.acquire("user: tell me a long story about the sea and its old ships")
    slots.prepare(idle, "completion", {"prompt": "a long story " * 100})
    slots.release(idle)
    engine = LlamaEngine(lambda: 1)
    engine._slot_pool = slots
    engine._server = object()  # loaded, as far as relieve can tell
    engine.relieve(1)  # what the worker calls on a rising level
    assert control.calls == [] and list((tmp_path / "kv").glob("**/*.kv*")) == []


class _CharEngine:
    """The engine's control socket at the edge: a chat template that joins the turns, a
    tokenizer with one token per character (BOS = 1), and a record of what it tokenized."""

    def __init__(self, slot_dir: Path | None = None) -> None:
        self.tokenized: list[tuple[str, bool]] = []
        self.renders = 0
        self.slot_dir = slot_dir  # where slot saves go (the runner's private directory)

    @staticmethod
    def render(messages: list[dict[str, str]]) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    @staticmethod
    def tokens(text: str) -> tuple[int, ...]:
        return (1, *(ord(c) for c in text))

    def request(self, method: str, path: str, body: Any = None) -> Any:
        if path == "/apply-template":
            self.renders += 1
            return {"prompt": self.render(body["messages"])}
        if path.endswith("?action=save"):
            assert self.slot_dir is not None
            state = SEQ_MAGIC.to_bytes(4, "little") + (4).to_bytes(4, "little") + b"\0" * 64
            (self.slot_dir / body["filename"]).write_bytes(state)
            return {}
        if path.endswith("?action=restore"):
            return {}
        assert path == "/tokenize", path
        self.tokenized.append((body["content"], body["add_special"]))
        bos = [1] if body["add_special"] else []
        return {"tokens": bos + [ord(c) for c in body["content"]]}


class _Lookups(PrefixCache):
    """The prefix cache, recording the tokens each disk-tier lookup was given."""

    seen: list[tuple[tuple[int, ...], int]]

    def lookup(self, tokens: Any, live: int = 0) -> Any:
        self.seen.append((tuple(tokens), live))
        return super().lookup(tokens, live)


def _with_a_saved_state(engine: _CharEngine, tmp_path: Path, n: int) -> tuple[_Lookups, Slots]:
    """``n`` slots over a disk tier holding another conversation's state (so that a
    request's ``prepare`` looks its prompt up)."""
    cache = _Lookups(
        CacheKey("m", 1024, "f16"), block_tokens=64, ram_budget=0, disk_dir=tmp_path / "kv",
        disk_max=MiB,
    )  # fmt: skip
    cache.seen = []
    state = SEQ_MAGIC.to_bytes(4, "little") + (4).to_bytes(4, "little") + b"\0" * 64
    assert cache.store(tuple(range(2, 200)), state)
    cache.flush()
    return cache, Slots(cast(EngineControl, engine), n, cache, tmp_path, block_tokens=64)


def test_a_conversation_s_next_turn_tokenizes_only_what_it_adds(tmp_path: Path) -> None:
    engine = _CharEngine()
    cache, slots = _with_a_saved_state(engine, tmp_path, 2)

    def turn(messages: list[dict[str, str]]) -> int:
        rendered = engine.render(messages)
        slot = slots.acquire(rendered)
        slots.prepare(slot, "chat", {"messages": messages})
        slots.release(slot)
        return slot

    first = [{"role": "user", "content": "Tell me about the sea and its old ships. " * 3}]
    second = [*first, {"role": "assistant", "content": "It is wide."}]
    second.append({"role": "user", "content": "And deep?"})
    one, two = engine.render(first), engine.render(second)
    slot = turn(first)
    assert turn(second) == slot  # the conversation keeps its slot
    # The second turn sent only what it added (no BOS), and the lookup saw exactly the
    # whole prompt's tokens, with the first turn's as the slot's live prefix.
    assert engine.tokenized == [(one, True), (two[len(one) :], False)]
    assert cache.seen[-1] == (engine.tokens(two), len(engine.tokens(one)))
    # A rewritten answer: the prompt no longer extends what the slot served, so it is
    # tokenized whole (on the same slot: it still shares the long first turn).
    edited = [*first, {"role": "assistant", "content": "It is very wide."}, second[2]]
    assert turn(edited) == slot
    assert engine.tokenized[-1] == (engine.render(edited), True)
    assert cache.seen[-1][0] == engine.tokens(engine.render(edited))


def test_a_continuation_looks_nothing_up_but_its_prompt_is_saved_by_its_text(
    tmp_path: Path,
) -> None:
    """A preempted stream's continuation restores its own saved state: a disk-tier lookup
    would render and tokenize its ~1,800-token prompt on the engine's cores while the
    request that took its slot prefills (``prepare(lookup=False)``). Its slot still notes
    the prompt, so a later save indexes the state by this prompt, not the slot's last."""
    engine = _CharEngine(tmp_path)
    cache, slots = _with_a_saved_state(engine, tmp_path, 1)
    before = [{"role": "user", "content": "What was here before. " * 4}]
    slot = slots.acquire("x")
    slots.prepare(slot, "chat", {"messages": before})
    slots.release(slot)
    looked, renders = len(cache.seen), engine.renders
    resumed = [{"role": "user", "content": "Tell me about the sea and its old ships. " * 3}]
    slot = slots.acquire(engine.render(resumed), resumed=True)
    assert slots.prepare(slot, "chat", {"messages": resumed}, lookup=False) == 0
    assert (len(cache.seen), engine.renders) == (looked, renders)  # nothing rendered
    slots.release(slot)
    assert slots.save_all() == 1
    assert engine.tokenized[-1] == (engine.render(resumed), True)  # indexed by its own text


def test_a_new_runner_tokenizes_only_what_a_saved_prompt_lacks(tmp_path: Path) -> None:
    """The disk tier keeps each saved prompt's text: a runner started later (after a swap
    or a restart) tokenizes only what a request adds to it, or nothing for the same one."""
    key = CacheKey("m", 1024, "f16")

    def runner() -> tuple[_CharEngine, _Lookups, Slots]:
        engine = _CharEngine(tmp_path)
        cache = _Lookups(key, block_tokens=64, ram_budget=0, disk_dir=tmp_path / "kv", disk_max=MiB)
        cache.seen = []
        return engine, cache, Slots(cast(EngineControl, engine), 1, cache, tmp_path, 64)

    first = [{"role": "user", "content": "Tell me about the sea and its old ships. " * 3}]
    engine, cache, slots = runner()
    slot = slots.acquire("a")
    slots.prepare(slot, "chat", {"messages": first})  # no entries yet: nothing tokenized
    slots.release(slot)
    assert slots.save_all() == 1  # the runner stops: its slot's state goes to disk
    one = engine.render(first)
    assert engine.tokenized == [(one, True)]  # the save indexes the state by whole tokens

    second = [*first, {"role": "assistant", "content": "Wide."}, {"role": "user", "content": "?"}]
    for messages, sent in ((first, []), (second, [(engine.render(second)[len(one) :], False)])):
        engine, cache, slots = runner()  # a new runner: its slots know nothing yet
        slot = slots.acquire("a")
        slots.prepare(slot, "chat", {"messages": messages})
        slots.release(slot)
        assert engine.tokenized == sent
        assert cache.seen[-1][0] == engine.tokens(engine.render(messages))
    # Stopping, a runner indexes its slot's state by whole tokens: those its lookup had
    # when they were whole (a saved prompt, repeated), else the prompt tokenized again.
    two = engine.render(second)
    for messages, stored, calls in ((first, 0, []), (second, 1, [(two, True)])):
        engine, cache, slots = runner()
        slot = slots.acquire("a")
        slots.prepare(slot, "chat", {"messages": messages})
        slots.release(slot)
        engine.tokenized.clear()
        renders = engine.renders
        assert slots.save_all() == stored  # the first is on disk already
        assert engine.tokenized == calls
        assert engine.renders == renders + len(calls)


@pytest.mark.parametrize("level", [1, 2])
def test_relief_saves_no_slot_state_at_any_level(tmp_path: Path, level: int) -> None:
    """``relieve`` once ignored its level (a jump to hard started a 0.2-0.9 s save), then
    saved at soft only; a save under pressure stalls the engine's loop and adds copies of
    the state to the cgroup, so no level saves (an unload at soft still saves in close)."""
    from elbowroom.engines.llama import LlamaEngine

    control = _CountingControl()
    key = CacheKey("m", 1024, "f16")
    cache = PrefixCache(key, block_tokens=64, ram_budget=0, disk_dir=tmp_path / "kv", disk_max=MiB)
    slots = Slots(cast(EngineControl, control), 1, cache, tmp_path, block_tokens=64)
    idle = slots.acquire("user: tell me a long story about the sea and its old ships")
    slots.prepare(idle, "completion", {"prompt": "a long story"})
    slots.release(idle)
    engine = LlamaEngine(lambda: level)
    engine._slot_pool, engine._server = slots, object()  # a loaded engine, at its edges
    engine.relieve(level)
    assert control.calls == [] and list((tmp_path / "kv").glob("**/*.kv*")) == []


def test_the_engine_tells_a_prefilling_holder_from_a_generating_one() -> None:
    """``LlamaEngine._holder`` from the engine's ``GET /slots``: a slot taken but not yet
    processing, or processing with nothing decoded, is prefilling (wait for it); a
    generating slot is preempted only when asked to and held by a resumable stream; an
    engine that cannot be read is "kept" (the request waits blind, as before)."""
    engine, control, slots, notices = _engine_on_slots(2)
    slot = slots.acquire("system: " + "rules " * 400)
    engine._resumable[7] = slot
    assert engine._holder(slot, True) is Holder.PREFILLING  # its request not at the engine yet
    control.state[slot] = (True, 0)
    assert engine._holder(slot, True) is Holder.PREFILLING
    control.state[slot] = (True, 3)
    assert engine._holder(slot, False) is Holder.KEPT and not notices
    assert engine._holder(slot, True) is Holder.PREEMPTED
    assert notices == [{"preempt": 7, "cached": 0}]  # what the engine reused for it
    assert engine._holder(slot, True) is Holder.KEPT  # that stream is no longer resumable

    class _Unreadable:
        def request(self, *a: Any, **k: Any) -> Any:
            raise OSError("engine gone")

    engine._control = cast(EngineControl, _Unreadable())
    assert engine._holder(slot, True) is Holder.KEPT
