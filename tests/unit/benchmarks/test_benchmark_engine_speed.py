"""The arithmetic of benchmarks/engine_speed.py: what a round measures and how targets are
judged. The systems themselves (real servers, the real engine) run in the benchmark."""

from __future__ import annotations

import argparse
import math

import engine_speed as es
import pytest


def test_percentile_interpolates_between_ranks() -> None:
    assert es.percentile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    assert es.percentile([1.0, 2.0, 3.0, 4.0], 0.95) == pytest.approx(3.85)
    assert es.percentile([7.0], 0.95) == 7.0
    assert math.isnan(es.percentile([], 0.5))


def test_timer_counts_content_tokens_and_prefers_reported_usage() -> None:
    timer = es.StreamTimer()
    timer.feed({"choices": [{"delta": {"role": "assistant", "content": None}}]})
    timer.feed({"choices": [{"delta": {"content": ""}}]})
    assert timer.first == 0.0  # role and empty chunks are not the first token
    timer.feed({"choices": [{"delta": {"content": "Once"}}]})
    first = timer.first
    timer.feed({"choices": [{"delta": {"content": " upon"}}]})
    assert first > 0 and timer.first == first and timer.chunks == 2
    assert timer.done().tokens == 2  # no usage reported: the chunks count
    timer.feed({"choices": [], "usage": {"completion_tokens": 3}})
    stream = timer.done()
    assert stream.tokens == 3 and stream.chunks == 2 and stream.ttft == first - timer.sent


class FakeSystem:
    """Streams with fixed token counts, the first token after ``delay`` seconds."""

    name = "fake"

    def __init__(self, tokens: int, chunks: int) -> None:
        self.tokens, self.chunks = tokens, chunks

    def stream(self, tag: str, max_tokens: int) -> es.Stream:
        sent = es.time.perf_counter()
        return es.Stream(sent, sent + 0.010, sent + 0.020, self.tokens, self.chunks)

    def cpu(self) -> dict[str, float]:
        return {"server": 0.0}

    def stop(self) -> None:
        pass


def test_round_sums_tokens_over_its_wall_time() -> None:
    rd = es.run_round(FakeSystem(16, 16), 4, 4, 1, 0, 16)
    assert rd.tokens == 64 and rd.tokens_each == (16, 16, 16, 16)
    assert rd.agg_tps == pytest.approx(64 / rd.wall_s)
    assert rd.wall_s >= 0.020
    assert rd.ttft_p50_s == pytest.approx(0.010, abs=1e-6)
    assert rd.errors == ()
    assert set(rd.cpu_ms_per_token) == {"server", "client"}


def test_round_flags_usage_that_disagrees_with_the_stream() -> None:
    rd = es.run_round(FakeSystem(16, 9), 1, 4, 1, 0, 16)
    assert rd.errors and "usage says 16 tokens, 9 content chunks" in rd.errors[0]


def _cell(tps: float, p95: float) -> dict[str, object]:
    return {"agg_tps": {"median": tps}, "ttft_p95_s": {"median": p95}}


def test_targets_pass_at_their_bounds_and_fail_past_them() -> None:
    table = {
        "elbowroom": {"1": _cell(95.0, 0.1), "4": _cell(94.9, 0.30)},
        "llama-server:native": {"1": _cell(100.0, 0.1), "4": _cell(100.0, 0.20)},
    }
    got = {v["target"]: v["pass"] for v in es.verdicts(table, [1, 4], "llama-server:native")}
    assert got == {
        "aggregate tok/s at 1 streams >= 0.95x llama-server:native": True,
        "aggregate tok/s at 4 streams >= 0.95x llama-server:native": False,
        "p95 TTFT at 4 streams <= 1.5x llama-server:native": True,
    }
    table["elbowroom"]["4"] = _cell(100.0, 0.31)
    ttft = es.verdicts(table, [4], "llama-server:native")[-1]
    assert ttft["pass"] is False and ttft["ratio"] == pytest.approx(1.55)


def test_slots_are_four_up_to_four_streams_then_the_stream_count() -> None:
    assert [es.slots_for(n) for n in (1, 4, 8)] == [4, 4, 8]


def test_system_names_are_checked() -> None:
    assert es._names("elbowroom,llama-server,xllamacpp") == [
        "elbowroom",
        "llama-server:native",
        "xllamacpp",
    ]
    assert es._names("xllamacpp:http") == ["xllamacpp:http"]
    with pytest.raises(argparse.ArgumentTypeError, match="llama-server"):
        es._names("elbowroom,llama-server:avx9")
    with pytest.raises(argparse.ArgumentTypeError, match="xllamacpp"):
        es._names("xllamacpp:grpc")


def test_ratio_rows_divide_each_system_by_the_baseline() -> None:
    def cell(tps: float, ttft: float) -> dict[str, dict[str, float]]:
        return {"agg_tps": {"median": tps}, "ttft_p95_s": {"median": ttft}}

    result = {
        "baseline": "llama-server:native",
        "systems": ["elbowroom", "llama-server:native"],
        "streams": [1, 4],
        "table": {
            "elbowroom": {"1": cell(90.0, 0.1), "4": cell(150.0, 0.45)},
            "llama-server:native": {"1": cell(100.0, 0.1), "4": cell(160.0, 0.3)},
        },
    }
    rows = es._ratio_rows(result)
    assert rows[2] == "| system | tok/s, 1 stream | tok/s, 4 streams | TTFT p95, 4 streams |"
    assert rows[4] == "| elbowroom | 0.900 | 0.938 | 1.500 |"
    assert len(rows) == 5  # the baseline gets no row of its own
    assert "was not run" in es._ratio_rows({**result, "baseline": "xllamacpp"})[0]
