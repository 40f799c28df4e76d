import pytest

from elbowroom import errors
from elbowroom.units import GiB, KiB, MiB, format_size, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8GiB", 8 * GiB),
        ("512 MiB", 512 * MiB),
        ("1.5G", int(1.5 * GiB)),
        ("4096", 4096),
        ("2KB", 2000),
        ("3k", 3 * KiB),
        (77, 77),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "GiB", "8 parsecs", "-1", "1..2G"])
def test_parse_size_rejects(bad: str) -> None:
    with pytest.raises(ValueError, match="cannot parse size"):
        parse_size(bad)


def test_format_size() -> None:
    assert format_size(0) == "0 B"
    assert format_size(1536) == "1.5 KiB"
    assert format_size(3 * GiB) == "3.0 GiB"
    assert format_size(-2 * MiB) == "-2.0 MiB"
    assert format_size(None) == "-"


def test_error_shapes_and_statuses() -> None:
    err = errors.InsufficientMemory("no room", details={"needed": 5, "available": 3})
    assert err.status == 507
    body = err.to_openai()["error"]
    assert body["type"] == "insufficient_memory"
    assert body["needed"] == 5
    assert errors.ModelNotFound("x").status == 404
    busy = errors.QueueFull("queue full", retry_after=2.4)
    assert busy.status == 503
    assert busy.headers() == {"Retry-After": "2"}


def test_errors_cross_the_pipe() -> None:
    original = errors.MemoryPressure("aborted", retry_after=3, code="memory_pressure")
    rebuilt = errors.ElbowroomError.from_wire(original.to_wire())
    assert isinstance(rebuilt, errors.MemoryPressure)
    assert rebuilt.status == 503
    assert rebuilt.retry_after == 3
    assert rebuilt.code == "memory_pressure"
    unknown = errors.ElbowroomError.from_wire({"class": "Nope", "message": "boom"})
    assert isinstance(unknown, errors.EngineError)
