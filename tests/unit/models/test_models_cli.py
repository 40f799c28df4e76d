"""`elbowroom ls` and `elbowroom plan`, run in-process against the real catalog and probe."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from gguf_files import write_gguf

from elbowroom.cli import main
from elbowroom.config import Settings
from elbowroom.memory.types import ProcessMemory
from elbowroom.models.catalog import discover
from elbowroom.models.measured import MeasuredStore
from elbowroom.units import MiB


@pytest.fixture
def data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ELBOWROOM_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("ELBOWROOM_OVERRIDE_MEMORY", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))  # no user config file
    return tmp_path / "data"


def limit_to(monkeypatch: pytest.MonkeyPatch, limit: int) -> list[str]:
    """Flags and env that make the budget exactly ``limit``: an 8 GiB override whose
    container margin leaves ``limit`` (the available candidate is far larger, whatever this
    process holds), so the numbers do not depend on the machine running the test."""
    monkeypatch.setenv("ELBOWROOM_CONTAINER_MARGIN", str(8 * 1024 * MiB - limit))
    return ["--override-memory", "8GiB"]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any]:
    code, out, _ = run(capsys, *argv, "--json")
    return code, json.loads(out)


def test_ls_json_lists_models_with_footprints(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    models = tmp_path / "models"
    write_gguf(models / "tiny.gguf")
    (models / "junk.gguf").write_text("nope")
    code, data = run_json(capsys, "ls", "--override-memory", "8GiB", "--models-dir", str(models))
    assert code == 0
    rows = {m["id"]: m for m in data["models"]}
    assert {"smollm2-135m", "tiny"} <= set(rows)
    smol = rows["smollm2-135m"]
    assert smol["n_ctx"] == 4096 and smol["n_ctx_source"] == "auto"  # max_ctx, per slot
    assert smol["fits"] is True and smol["shortfall"] == 0
    fp = smol["footprint"]
    assert fp["total"] == fp["anonymous"] + fp["file_backed"]
    assert fp["kv_bytes"] == 23040 * 4096 * 4  # four slots (the default) each own 4096
    assert rows["tiny"]["source"] == "models_dir"
    assert data["limit"]["winner"] in {c["name"] for c in data["limit"]["candidates"]}
    assert [p["path"] for p in data["problems"]] == [str(models / "junk.gguf")]
    assert data["unprepared"] in ([], ["gemma3-270m"])


def test_ls_table_for_people(data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "ls", "--override-memory", "8GiB")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == [
        "ID",
        "KIND",
        "ENGINE",
        "SIZE",
        "CTX",
        "FOOTPRINT",
        "FITS",
        "SOURCE",
    ]
    smol = next(line for line in lines if line.startswith("smollm2-135m"))
    assert smol.split()[-2:] == ["yes", "bundled"]
    assert "budget:" in out


def test_ls_marks_measured_footprints(data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    settings = Settings(data_dir=data_dir)
    spec = discover(settings).get("minilm-l6-v2")
    MeasuredStore(settings.measurements_path).record(
        spec, 0, 1, "f16", ProcessMemory(100 * MiB, 50 * MiB)
    )
    code, out, _ = run(capsys, "ls", "--override-memory", "8GiB")
    row = next(line for line in out.splitlines() if line.startswith("minilm-l6-v2"))
    assert code == 0 and "150.0 MiB (measured)" in row
    _, data = run_json(capsys, "ls", "--override-memory", "8GiB")
    fp = next(m for m in data["models"] if m["id"] == "minilm-l6-v2")["footprint"]
    assert fp["measured"] is True and fp["total"] == 150 * MiB


def test_ls_small_budget_says_what_does_not_fit(
    data_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, data = run_json(capsys, "ls", *limit_to(monkeypatch, 150 * MiB))
    assert code == 0  # listing is not a failure
    assert (data["limit"]["value"], data["limit"]["winner"]) == (150 * MiB, "container")
    for m in data["models"]:
        assert m["fits"] == (m["footprint"]["total"] <= 150 * MiB), m["id"]
    fits = {m["id"]: m["fits"] for m in data["models"]}
    assert fits["smollm2-135m"] is False  # not even min_ctx fits
    assert fits.get("minilm-l6-v2", True) is True


def test_plan_json_arithmetic(data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, data = run_json(
        capsys,
        "plan",
        "smollm2-135m",
        "--ctx",
        "4096",
        "--kv-type",
        "q8_0",
        "--override-memory",
        "8GiB",
    )
    assert code == 0
    fp = data["footprint"]
    assert (fp["n_ctx"], fp["kv_type"], fp["kv_bytes_per_token"]) == (4096, "q8_0", 12240)
    assert fp["kv_bytes"] == 12240 * 4096 * fp["slots"]
    assert fp["anonymous"] == fp["kv_bytes"] + fp["overhead"]
    assert data["context"]["source"] == "--ctx"
    assert data["context"]["largest_fitting"] == 8192
    assert data["fit"]["ok"] is True and data["fit"]["needed"] == fp["total"]
    assert data["model"]["gguf"]["n_layers"] == 30
    assert data["suggestions"] == []


def test_plan_text_walks_through_the_steps(
    data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(capsys, "plan", "smollm2-135m", "--override-memory", "8GiB")
    assert code == 0
    for step in range(1, 9):
        assert f"\n{step}. " in out
    # four slots (the default), each with its own context
    assert "22.5 KiB/token; × 4096 × 4 slot(s) = 360.0 MiB" in out
    assert "rule: override" in out and "prompt-cache grant:" in out
    assert "largest context that fits: 8192 (auto-sizing stops at max_ctx 4096)" in out


def test_plan_that_cannot_fit_exits_1_with_the_numbers(
    data_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out, err = run(capsys, "plan", "smollm2-135m", *limit_to(monkeypatch, 150 * MiB))
    assert code == 1
    assert "min_ctx (auto: none fits)" in out
    assert "DOES NOT FIT" in out and "short by" in out
    assert "does not fit" in err and "short by" in err


def test_plan_suggests_a_context_that_fits(
    data_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    flags = limit_to(monkeypatch, 360 * MiB)  # load ceiling 306 MiB
    code, data = run_json(capsys, "plan", "smollm2-135m", "--ctx", "8192", "--slots", "1", *flags)
    assert code == 1
    largest = data["context"]["largest_fitting"]
    assert 0 < largest < 8192 and largest % 256 == 0
    assert data["fit"]["shortfall"] > 0
    # The server's 507 suggestions, word for word (scheduler.policy.refuse).
    assert data["suggestions"] == [
        f"set --ctx {largest} (context 8192 does not fit)",
        "set --kv-type q8_0 (about halves the KV cache)",
    ]


def test_plan_resident_model(data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", "whisper-tiny.en", "--override-memory", "8GiB")
    assert code == 0
    assert "context: none" in out


def test_plan_unknown_model(data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "plan", "../../etc/passwd")
    assert code == 1 and out == ""
    assert "no model '../../etc/passwd'" in err and "smollm2-135m" in err


def test_plan_rejects_a_bad_kv_type(data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["plan", "smollm2-135m", "--kv-type", "f32"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_plan_and_ls_use_the_models_own_slots(
    data_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ELBOWROOM_MODEL_SLOTS", "smollm2-135m=2")
    code, data = run_json(capsys, "plan", "smollm2-135m", "--override-memory", "8GiB")
    assert code == 0 and data["footprint"]["slots"] == 2
    code, listed = run_json(capsys, "ls", "--override-memory", "8GiB")
    smol = next(m for m in listed["models"] if m["id"] == "smollm2-135m")
    assert smol["footprint"]["slots"] == 2
