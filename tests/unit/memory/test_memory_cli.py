"""`elbowroom memory`: the table, --json, --watch, the override flag, bad input."""

from __future__ import annotations

import json

import pytest

from elbowroom.cli import main
from elbowroom.units import GiB


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["memory", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_table_marks_the_winner_and_shows_the_level(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--override-memory", "2GiB")
    assert code == 0
    assert "total" in out and "2.0 GiB" in out
    assert "override           2.0 GiB" in out
    winners = [line for line in out.splitlines() if line.startswith("*")]
    assert len(winners) == 1
    # An override is a container: a 5 % margin (102.4 MiB), not the host's OS reserve; what
    # this test process holds of the 2 GiB may make "available" the smaller candidate.
    assert "rule: override (ELBOWROOM_OVERRIDE_MEMORY 2.0 GiB caps the host's" in out
    assert "container margin 102.4 MiB" in out
    assert winners[0].split()[1] in ("container", "available")
    assert "OS reserve " not in out  # no tiered reserve candidate
    limit_line = next(line for line in out.splitlines() if line.startswith("limit "))
    ceiling_line = next(line for line in out.splitlines() if line.startswith("ceiling "))
    # The limit is GiB-sized unless this test process holds much of the 2 GiB (the whole
    # suite imports the third-party clients and MLX into it): "available" then wins.
    assert "GiB" in limit_line or "(available)" in limit_line, limit_line
    assert "(85% of the limit: loads stop here)" in ceiling_line
    assert "pressure: " in out


def test_json_is_one_sample(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--json", "--override-memory", "2GiB")
    assert code == 0
    data = json.loads(out)
    assert data["snapshot"]["total"] == 2 * GiB
    assert data["snapshot"]["override"] == 2 * GiB
    assert data["own_usage"] == 0
    assert data["level"] in ("normal", "soft", "hard")
    assert sum(c["winner"] for c in data["limit"]["candidates"]) == 1


def test_watch_prints_a_line_per_sample(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--watch", "0.01", "--count", "3")
    lines = out.strip().splitlines()
    assert code == 0
    assert lines[0].startswith("time") and "level" in lines[0]
    assert len(lines) == 4
    assert all(line.split()[-1] in ("normal", "soft", "hard") for line in lines[1:])


def test_watch_json_prints_json_lines(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--json", "--watch", "0.01", "--count", "2")
    samples = [json.loads(line) for line in out.strip().splitlines()]
    assert code == 0
    assert len(samples) == 2
    assert samples[0]["at"] <= samples[1]["at"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--watch", "0"], "--watch SECONDS must be > 0"),
        (["--watch", "1", "--count", "0"], "--count must be >= 1"),
        (["--override-memory", "lots"], "cannot parse size"),
    ],
)
def test_bad_input_exits_2_with_a_message(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert message in err
