"""The chaos benchmark's pure parts: the neighbour's pattern per seed and how a request's
answer is counted (benchmarks/chaos.py; the benchmark itself needs root and cgroup v1)."""

from __future__ import annotations

import random

from chaos import (
    RETRIES,
    STEP_MIB,
    Result,
    client_time,
    level_seconds,
    neighbour_pattern,
    outcome,
    retry_delay,
)


def test_neighbour_pattern_is_the_seeds_own_and_fills_the_duration() -> None:
    a = neighbour_pattern(random.Random(1), 90, 1280, (0.6, 0.72), 64)
    assert a == neighbour_pattern(random.Random(1), 90, 1280, (0.6, 0.72), 64)
    assert a != neighbour_pattern(random.Random(2), 90, 1280, (0.6, 0.72), 64)
    assert sum(b.rest_s + b.ceiling / b.rate + b.hold_s for b in a) >= 90
    for b in a:
        assert int(1280 * 0.6) <= b.ceiling <= int(1280 * 0.72)
        assert 64 <= b.rate <= 128 and b.rate % STEP_MIB == 0


def _answer(status: int, error: str = "", message: str = "") -> str:
    return outcome(Result(0, 1, "chat", "m", status, error, message))


def test_outcome_tells_refusals_aborts_and_failures_apart() -> None:
    assert _answer(200) == "served"
    assert _answer(507, "insufficient_memory/insufficient_memory") == "507"
    assert _answer(503, "memory_pressure/memory_pressure", "The server is under hard") == "503"
    aborted = "generation aborted: memory pressure is hard (after 16 tokens)"
    assert _answer(503, "memory_pressure/memory_pressure", aborted) == "aborted"
    assert _answer(503, "service_unavailable/runner_crashed", "runner died") == "failed"
    assert _answer(0, "APITimeoutError") == "failed"
    assert _answer(500, "server_error/-") == "failed"


def test_level_seconds_count_each_sample_until_the_next() -> None:
    history = [
        {"t": 0.0, "level": "normal"},
        {"t": 0.5, "level": "soft"},
        {"t": 1.5, "level": "hard"},
        {"t": 2.0, "level": "normal"},
    ]
    assert level_seconds(history) == {"soft": 1.0, "hard": 0.5}


def test_the_fast_neighbour_grows_its_bursts_within_the_duration() -> None:
    from chaos import SCENARIOS, fixed_pattern

    rate, ceiling, bursts = SCENARIOS["fast"].fixed or (0, 0, 0)
    assert (rate, ceiling, bursts) == (320, 896, 3)
    a = fixed_pattern(random.Random(1), 75, rate, ceiling, bursts)
    assert a == fixed_pattern(random.Random(1), 75, rate, ceiling, bursts)
    assert len(a) == 3 and all(b.rate == 320 and b.ceiling == 896 for b in a)
    assert sum(b.rest_s + b.ceiling / b.rate + b.hold_s for b in a) <= 75


def test_a_refused_request_is_retried_after_retry_after_at_most_twice() -> None:
    assert RETRIES == 2
    assert retry_delay(503, 5.0, 0) == 5.0  # Retry-After honoured
    assert retry_delay(507, 0.0, 1) == 1.0  # none given: a second
    assert retry_delay(503, 5.0, 2) is None  # bounded
    assert retry_delay(200, 0.0, 0) is None
    assert retry_delay(0, 0.0, 0) is None  # a timeout or a dropped connection: not retried
    assert retry_delay(500, 0.0, 0) is None


def test_client_time_says_what_each_client_waited_on() -> None:
    paused = "cannot load 'smollm2-135m' now: loads are paused under memory pressure"
    results = [
        Result(0.0, 40.0, "chat", "smollm2-135m", 503, "memory_pressure/-", paused),
        Result(0.0, 20.0, "chat", "gemma3-270m", 200),
        Result(20.0, 50.0, "chat", "gemma3-270m", 200),
        Result(1.0, 1.1, "chat", "gemma3-270m", 507, "insufficient_memory/insufficient_memory"),
        Result(2.0, 3.0, "embeddings", "minilm-l6-v2", 503, "service_unavailable/runner_crashed"),
    ]
    assert client_time(results) == {
        "chat 503 (loads paused)": {"n": 1, "s": 40.0},
        "chat 507 (insufficient_memory)": {"n": 1, "s": 0.1},
        "chat served": {"n": 2, "s": 50.0},
        "embeddings failed (runner_crashed)": {"n": 1, "s": 1.0},
    }
