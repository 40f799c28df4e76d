"""/metrics renders an MLX runner's own memory accounting (engine_stats.mlx)."""

from prometheus_client.parser import text_string_to_metric_families

from elbowroom.server.http.metrics import ScrapeState, render


def test_mlx_memory_gauges() -> None:
    state = ScrapeState()
    state.mlx["tiny-mlx"] = {"active": 10, "cache": 0, "peak": 30, "memory_limit": 99}
    text = render(state).decode()
    samples = {
        (s.labels["model"], s.labels["kind"]): s.value
        for family in text_string_to_metric_families(text)
        if family.name == "elbowroom_mlx_memory_bytes"
        for s in family.samples
    }
    assert samples == {
        ("tiny-mlx", "active"): 10,
        ("tiny-mlx", "cache"): 0,
        ("tiny-mlx", "peak"): 30,
        ("tiny-mlx", "limit"): 99,
    }
    assert "elbowroom_mlx_memory_bytes" not in render(ScrapeState()).decode()
