"""The preempted stream's side of preempt and resume (server/stream/resume.py): what the client
already has becomes the continuation's prefill, and the continuation's events and usage
read as the same stream's."""

from __future__ import annotations

import json
from typing import Any

from elbowroom.engines.llama import resumable
from elbowroom.engines.requests import TextRequest
from elbowroom.server.stream.resume import Resume, sent_text


def event(chunk: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"  # as the engine


def delta(text: str | None, sid: str = "chatcmpl-A", role: bool = False) -> bytes:
    d: dict[str, Any] = {"content": text}
    if role:
        d["role"] = "assistant"
    return event({"id": sid, "choices": [{"index": 0, "delta": d, "finish_reason": None}]})


CHAT = TextRequest(
    kind="chat",
    max_tokens=100,
    messages=({"role": "user", "content": "hi"},),
    seed=7,
    temperature=0.0,
    stream=True,
)


def test_the_continuation_prefills_what_the_client_has() -> None:
    resume = Resume(CHAT)
    resume.record(delta(None, role=True) + delta("Hel"))
    resume.record(delta("lo"))
    resume.preempt()
    more = resume.continuation(5)
    assert more.messages[-1] == {"role": "assistant", "content": "Hello"}
    assert more.messages[:-1] == CHAT.messages
    assert more.max_tokens == 98 and more.resumed == 5
    assert more.seed == 7 and more.temperature == 0.0 and more.stream
    completion = TextRequest(kind="completion", max_tokens=3, prompt="Once", stream=True)
    resume = Resume(completion)
    resume.record(event({"id": "cmpl-1", "choices": [{"index": 0, "text": " upon"}]}))
    resume.record(event({"id": "cmpl-1", "choices": [{"index": 0, "text": " a"}]}))
    resume.record(event({"id": "cmpl-1", "choices": [{"index": 0, "text": " time"}]}))
    more = resume.continuation(9)
    assert more.prompt == "Once upon a time" and more.max_tokens == 1


def test_the_continuation_reads_as_the_same_stream() -> None:
    resume = Resume(CHAT)
    resume.record(delta(None, role=True) + delta("Hel"))
    resume.record(delta("lo"))
    resume.preempt()
    resume.continuation(5)
    out = resume.splice(delta(None, sid="chatcmpl-B", role=True) + delta(" you", "chatcmpl-B"))
    assert out == delta(" you", "chatcmpl-A")  # the first id, no second opening chunk
    assert sent_text(out, chat=True) == (" you", 1)
    usage = {
        "prompt_tokens": 12,  # 10 of the prompt + the 2 sent tokens, prefilled
        "completion_tokens": 5,
        "total_tokens": 17,
        "prompt_tokens_details": {"cached_tokens": 12},
    }
    resume.fix_usage(usage)
    assert usage["prompt_tokens"] == 10 and usage["completion_tokens"] == 7
    assert usage["total_tokens"] == 17
    assert usage["prompt_tokens_details"] == {"cached_tokens": 10}
    assert resume.stall_s is not None and resume.stall_s >= 0


def test_a_resumed_streams_cached_tokens_are_the_preempted_requests() -> None:
    """The continuation restores the preempted slot's whole state, so the engine calls its
    whole prompt cached; the client's request reused only what the engine reused for it
    before the preemption (the runner's notice says how many). The arena counted a
    switch's cold prefill as 1,600 tokens cached."""
    resume = Resume(CHAT)
    resume.record(delta(None, role=True) + delta("Hel"))
    resume.preempt()
    resume.cached = 0  # the preempted request computed its prompt
    resume.continuation(5)
    usage = {"prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16}
    usage["prompt_tokens_details"] = {"cached_tokens": 11}
    resume.fix_usage(usage)
    assert usage["prompt_tokens"] == 10 and usage["prompt_tokens_details"] == {"cached_tokens": 0}
    resume.cached = 64  # it had reused a prefix
    usage = {"prompt_tokens": 11, "completion_tokens": 5, "prompt_tokens_details": {}}
    usage["prompt_tokens_details"] = {"cached_tokens": 11}
    resume.fix_usage(usage)
    assert usage["prompt_tokens_details"] == {"cached_tokens": 10}  # at most the prompt


def test_only_plain_text_streams_are_resumable() -> None:
    assert resumable(CHAT)
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}
    tool = {"type": "function", "function": {"name": "f"}}
    for refused in (
        TextRequest(kind="chat", max_tokens=5, stream=False),  # not a stream
        TextRequest(kind="chat", max_tokens=5, stream=True, isolated=True),  # cache_salt
        TextRequest(kind="chat", max_tokens=5, stream=True, resumed=3),  # resumed once
        TextRequest(kind="chat", max_tokens=5, stream=True, response_format=schema),
        TextRequest(kind="chat", max_tokens=5, stream=True, tools=(tool,)),
    ):
        assert not resumable(refused)


def test_whitespace_the_template_trims_from_the_prefill_is_not_sent_twice() -> None:
    """A preemption right after "rules above:\\n": the chat template trims the prefill's
    trailing newline, the model writes it again, and the client had it already (a slow
    reader's answer came out with a doubled newline)."""
    request = TextRequest(kind="chat", messages=({"role": "user", "content": "q"},), max_tokens=64)
    resume = Resume(request)
    first = {"id": "a", "choices": [{"delta": {"content": "rules above:\n"}}]}
    resume.record(b"data: " + json.dumps(first).encode() + b"\n\n")
    cont = resume.continuation(7)
    assert cont.messages[-1] == {"role": "assistant", "content": "rules above:"}
    again = {"id": "b", "choices": [{"delta": {"content": "\n1. Rule"}}]}
    out = resume.splice(b"data: " + json.dumps(again).encode() + b"\n\n")
    assert json.loads(out[6:].strip())["choices"][0]["delta"]["content"] == "1. Rule"
    more = {"id": "b", "choices": [{"delta": {"content": "\n2."}}]}
    out = resume.splice(b"data: " + json.dumps(more).encode() + b"\n\n")
    assert json.loads(out[6:].strip())["choices"][0]["delta"]["content"] == "\n2."
