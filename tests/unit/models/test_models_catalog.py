"""Catalog discovery over a real temporary models folder."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
from gguf_files import write_gguf
from vision_gguf import write_projector

from elbowroom.config import Settings
from elbowroom.errors import ModelNotFound
from elbowroom.models.bundled import BUNDLED_IDS
from elbowroom.models.catalog import Catalog, discover, slug, unique_id
from elbowroom.models.spec import Holding, ModelKind

ID = re.compile(r"^[a-z0-9][a-z0-9._-]*$")


def touch(path: Path, data: bytes = b"x" * 100) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    root = tmp_path_factory.mktemp("models")
    (root / "bundled-again.gguf").symlink_to(smollm2_path)  # the bundled file: listed once
    try:
        os.link(smollm2_path, root / "SmolLM2 Copy.Q4_1.gguf")  # same bytes, its own path
    except OSError:
        shutil.copyfile(smollm2_path, root / "SmolLM2 Copy.Q4_1.gguf")
    write_gguf(root / "a" / "Tiny.gguf")
    write_gguf(root / "b" / "tiny.gguf")  # same id as a/Tiny.gguf -> suffixed
    write_gguf(root / "vision" / "llava.gguf")
    write_projector(root / "vision" / "mmproj-llava-f16.gguf", text_embd=64, image_size=224)
    touch(root / "whisper-base" / "model.bin", b"w" * 1000)
    touch(root / "whisper-base" / "config.json", b"{}")
    touch(root / "whisper-base" / "vocabulary.txt", b"v" * 10)
    touch(root / "e5-small" / "onnx" / "model.onnx", b"o" * 500)
    touch(root / "e5-small" / "tokenizer.json", b"{}")
    touch(root / "voices" / "en_GB-alan-low.onnx", b"p" * 700)
    touch(root / "voices" / "en_GB-alan-low.onnx.json", b"{}")
    touch(root / "voices" / "lonely.onnx")  # no .onnx.json: not a voice
    touch(root / "broken.gguf", b"not a gguf")
    touch(root / ".hidden" / "secret.gguf")
    touch(root / "download.gguf.part")
    touch(root / "README.md", b"hello")
    write_gguf(root / "split" / "big-00001-of-00002.gguf")
    touch(root / "split" / "big-00002-of-00002.gguf", b"s" * 4000)
    return root


@pytest.fixture(scope="module")
def catalog(models: Path, tmp_path_factory: pytest.TempPathFactory) -> Catalog:
    return discover(Settings(data_dir=tmp_path_factory.mktemp("data"), models_dir=models))


def by_source(catalog: Catalog, source: str) -> dict[str, object]:
    return {s.id: s for s in catalog.list() if s.source == source}


def test_models_dir_discovery(catalog: Catalog, models: Path) -> None:
    found = by_source(catalog, "models_dir")
    assert sorted(found) == [
        "big",
        "e5-small",
        "en_gb-alan-low",
        "llava",
        "smollm2-copy.q4_1",
        "tiny",
        "tiny-2",
        "whisper-base",
    ]
    whisper = catalog.get("whisper-base")
    assert (whisper.kind, whisper.engine, whisper.holding) == (
        ModelKind.ASR,
        "whisper",
        Holding.RESIDENT,
    )
    assert whisper.size_bytes == 1000 + 2 + 10
    embed = catalog.get("e5-small")
    assert (
        embed.engine == "onnx-embed" and embed.path == models / "e5-small" / "onnx" / "model.onnx"
    )
    assert embed.options["tokenizer"] == str(models / "e5-small" / "tokenizer.json")
    voice = catalog.get("en_gb-alan-low")
    assert voice.kind == ModelKind.TTS and voice.options["config"].endswith(".onnx.json")
    smol = catalog.get("smollm2-copy.q4_1")
    assert smol.gguf is not None and smol.gguf.n_layers == 30 and smol.holding == Holding.MMAP


def test_ids_are_url_safe_stable_and_collisions_suffixed(catalog: Catalog, models: Path) -> None:
    assert all(ID.match(s.id) and len(s.id) <= 64 for s in catalog.list())
    assert catalog.get("tiny").path == models / "a" / "Tiny.gguf"  # sorted path order
    assert catalog.get("tiny-2").path == models / "b" / "tiny.gguf"


def test_mmproj_is_attached_not_listed(catalog: Catalog, models: Path) -> None:
    assert not any("mmproj" in s.id for s in catalog.list())
    llava = catalog.get("llava")
    assert (
        llava.gguf is not None and llava.gguf.mmproj == models / "vision" / "mmproj-llava-f16.gguf"
    )
    assert llava.vision and llava.projector is not None
    assert llava.projector.projector_type == "gemma3" and llava.projector.image_tokens == 64


def test_split_model_listed_once_with_all_shards(catalog: Catalog, models: Path) -> None:
    big = catalog.get("big")
    shards = sorted((models / "split").iterdir())
    assert big.path == shards[0]
    assert big.size_bytes == sum(p.stat().st_size for p in shards)


def test_bad_files_become_problems_not_failures(catalog: Catalog, models: Path) -> None:
    problems = {p.path: p.reason for p in catalog.problems}
    assert list(problems) == [models / "broken.gguf"]
    assert "not a GGUF" in problems[models / "broken.gguf"]


def test_split_model_missing_a_shard_is_a_problem(tmp_path: Path) -> None:
    root = tmp_path / "models"
    write_gguf(root / "m-00001-of-00003.gguf")
    cat = discover(Settings(data_dir=tmp_path / "d", models_dir=root))
    assert "m" not in cat
    assert "missing shards" in cat.problems[0].reason


@pytest.mark.parametrize(
    "bad", ["../../etc/passwd", "/etc/passwd", "a/b", "", "TINY", "tiny/../tiny", "..", None, 3]
)
def test_only_catalog_ids_resolve(catalog: Catalog, bad: object) -> None:
    assert bad not in catalog
    with pytest.raises(ModelNotFound) as err:
        catalog.get(bad)  # type: ignore[arg-type]
    assert err.value.status == 404


def test_bundled_come_first_and_keep_their_ids(catalog: Catalog) -> None:
    bundled = by_source(catalog, "bundled")
    assert set(bundled) <= set(BUNDLED_IDS)
    assert "smollm2-135m" in bundled
    ids = [s.id for s in catalog.list()]
    assert ids[: len(bundled)] == list(bundled)


def test_model_paths_files_folders_and_missing(tmp_path: Path, models: Path) -> None:
    extra = write_gguf(tmp_path / "elsewhere" / "Extra Model!.gguf")
    settings = Settings(
        data_dir=tmp_path / "data",
        models_dir=tmp_path / "no-such-dir",
        model_paths=(
            extra,
            models / "whisper-base",
            models / "voices",
            tmp_path / "missing.gguf",
            models / "README.md",
        ),
    )
    cat = discover(settings)
    found = by_source(cat, "path")
    assert sorted(found) == ["en_gb-alan-low", "extra-model", "whisper-base"]
    reasons = {p.path.name: p.reason for p in cat.problems}
    assert reasons["missing.gguf"] == "no such file or folder"
    assert "not a model file" in reasons["README.md"]


def test_same_file_through_two_sources_is_listed_once(tmp_path: Path, models: Path) -> None:
    settings = Settings(
        data_dir=tmp_path / "data", models_dir=models, model_paths=(models / "a" / "Tiny.gguf",)
    )
    cat = discover(settings)
    assert [s.id for s in cat.list() if s.path.name == "Tiny.gguf"] == ["tiny"]


def test_id_collision_with_a_bundled_id(tmp_path: Path) -> None:
    root = tmp_path / "models"
    root.mkdir()
    write_gguf(root / "smollm2-135m.gguf")
    cat = discover(Settings(data_dir=tmp_path / "d", models_dir=root))
    assert cat.get("smollm2-135m").source == "bundled"
    assert cat.get("smollm2-135m-2").path == root / "smollm2-135m.gguf"


def test_symlink_loops_terminate(tmp_path: Path) -> None:
    root = tmp_path / "models"
    write_gguf(root / "m.gguf")
    (root / "loop").symlink_to(root)
    cat = discover(Settings(data_dir=tmp_path / "d", models_dir=root))
    assert [s.id for s in cat.list() if s.source == "models_dir"] == ["m"]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("SmolLM2-135M-Instruct.Q4_1", "smollm2-135m-instruct.q4_1"),
        ("  Über Model (v2)  ", "ber-model-v2"),
        ("../../etc/passwd", "etc-passwd"),
        ("...", "model"),
        ("a" * 100, "a" * 64),
    ],
)
def test_slug(name: str, expected: str) -> None:
    assert slug(name) == expected


def test_unique_id_stays_within_64_chars() -> None:
    base = "a" * 64
    assert unique_id(base, {base}) == "a" * 62 + "-2"
    assert unique_id("x", {"x", "x-2"}) == "x-3"


def test_duplicate_ids_in_a_hand_made_catalog_are_refused(catalog: Catalog) -> None:
    spec = catalog.get("tiny")
    with pytest.raises(ValueError, match="duplicate"):
        Catalog([spec, spec])
