"""Vision in the model layer: projector headers, pairing, the footprint terms, the gate."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
from bundled_models import bundled_spec
from gguf_files import write_gguf
from vision_gguf import write_projector

from elbowroom.config import Settings
from elbowroom.errors import InsufficientMemory
from elbowroom.models import projector_names, vision
from elbowroom.models.catalog import discover
from elbowroom.models.estimate import footprint
from elbowroom.models.gguf_meta import InvalidModel
from elbowroom.scheduler.vision_gate import settle_target
from elbowroom.units import MiB


def test_read_projector_shape(tmp_path: Path) -> None:
    proj = vision.read_projector(write_projector(tmp_path / "mmproj-x.gguf"))
    assert proj.projector_type == "gemma3"
    assert (proj.image_size, proj.patch_size, proj.merge) == (448, 14, 2)
    assert proj.n_patches == 32 * 32 and proj.image_tokens == 256
    assert 3.5 * MiB < proj.weight_bytes < (tmp_path / "mmproj-x.gguf").stat().st_size


def test_gemma3_without_scale_factor_merges_by_four(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "mmproj-g.gguf"
    write_projector(path)
    # Rewrite the file without the scale factor: clip.cpp then pools 4 x 4 for gemma3.
    reader = gguf.GGUFReader(str(path))
    out = gguf.GGUFWriter(str(tmp_path / "mmproj-h.gguf"), "clip")
    for field in reader.fields.values():
        if field.name.startswith(("GGUF.", "general.architecture")):
            continue
        if field.name == "clip.vision.projector.scale_factor":
            continue
        out.add_key_value(field.name, field.contents(), field.types[0], field.types[-1])
    for t in reader.tensors:
        out.add_tensor(t.name, t.data, raw_shape=list(reversed(t.shape.tolist())))
    out.write_header_to_file()
    out.write_kv_data_to_file()
    out.write_tensors_to_file()
    out.close()
    assert vision.read_projector(tmp_path / "mmproj-h.gguf").image_tokens == 8 * 8


def test_not_a_vision_projector_is_invalid(tmp_path: Path) -> None:
    with pytest.raises(InvalidModel, match="no vision encoder"):
        vision.read_projector(write_gguf(tmp_path / "mmproj-a.gguf", arch="clip"))
    with pytest.raises(InvalidModel, match="not a projector"):
        vision.read_projector(write_gguf(tmp_path / "mmproj-b.gguf"))
    (tmp_path / "mmproj-c.gguf").write_bytes(b"nope")
    with pytest.raises(InvalidModel, match="not a GGUF"):
        vision.read_projector(tmp_path / "mmproj-c.gguf")


@pytest.mark.parametrize(
    ("model", "projectors", "expected"),
    [
        ("llava.gguf", ["mmproj-llava-f16.gguf"], "mmproj-llava-f16.gguf"),
        # One projector in the folder pairs with every model there.
        ("anything.gguf", ["mmproj-f16.gguf"], "mmproj-f16.gguf"),
        (
            "gemma-3-4b-it-Q4_K_M.gguf",
            ["mmproj-qwen2.5-vl-3b-f16.gguf", "mmproj-gemma-3-4b-it-f16.gguf"],
            "mmproj-gemma-3-4b-it-f16.gguf",
        ),
        # Several, none sharing MIN_SHARED characters: none rather than a wrong one.
        ("llama.gguf", ["mmproj-qwen-f16.gguf", "mmproj-gemma-f16.gguf"], None),
        ("llama.gguf", [], None),
    ],
)
def test_pick_projector_by_name(model: str, projectors: list[str], expected: str | None) -> None:
    root = Path("/m")
    others = [root / "other.gguf", root / model]
    picked = projector_names.pick_projector(
        root / model, [*others, *(root / p for p in projectors)]
    )
    assert picked == (root / expected if expected else None)


def test_catalog_pairs_explicitly_and_reports_bad_projectors(tmp_path: Path) -> None:
    models = tmp_path / "models"
    write_gguf(models / "a" / "alpha.gguf")
    write_gguf(models / "a" / "mmproj-alpha.gguf", arch="clip")  # no vision encoder
    write_gguf(models / "b" / "beta.gguf")
    good = write_projector(tmp_path / "elsewhere" / "proj.gguf", text_embd=64, image_size=224)
    settings = Settings(
        data_dir=tmp_path / "data",
        models_dir=models,
        model_projectors=("beta=" + str(good), "gamma=/nowhere.gguf"),
    )
    catalog = discover(settings)
    assert not catalog.get("alpha").vision  # its projector is broken: a text model
    beta = catalog.get("beta")
    assert beta.projector is not None and beta.projector.path == good
    reasons = {p.path.name: p.reason for p in catalog.problems}
    assert "no vision encoder" in reasons["mmproj-alpha.gguf"]
    assert "no such model" in reasons["nowhere.gguf"]
    assert vision.capabilities(beta) == ["completion", "chat", "vision"]


def test_footprint_adds_the_projector(tmp_path: Path) -> None:
    text = bundled_spec("smollm2-135m")
    proj = vision.read_projector(write_projector(tmp_path / "mmproj-s.gguf"))
    seeing = dataclasses.replace(text, projector=proj)
    base, fp = footprint(text, 1024, 2), footprint(seeing, 1024, 2)
    cost = vision.extra_footprint(proj, 576)
    assert fp.total - base.total == cost.total
    assert fp.working - base.working == cost.working
    assert fp.kv_bytes == base.kv_bytes  # image tokens take context, not extra KV
    assert cost.at_load > proj.weight_bytes and cost.working > 0
    # A larger image means more encoder memory.
    big = dataclasses.replace(proj, image_size=896)
    assert vision.extra_footprint(big, 576).working > 2 * cost.working
    # The measured store keys vision and text models apart.
    assert seeing.identity != text.identity


def test_gate_verdicts(caplog: pytest.LogCaptureFixture) -> None:
    gib = 1 << 30
    assert vision.gate("v", True, 7 * gib, 10 * gib, 0.7).verdict is vision.Verdict.OK
    refused = vision.gate("v", True, 7 * gib + 1, 10 * gib, 0.7)
    assert refused.verdict is vision.Verdict.REFUSE
    warned = vision.gate("t", False, 9 * gib, 10 * gib, 0.7)
    assert warned.verdict is vision.Verdict.WARN
    assert vision.gate("v", True, 9 * gib, 10 * gib, 1.0).verdict is vision.Verdict.OK  # off
    with pytest.raises(InsufficientMemory) as info:
        vision.enforce(refused)
    err = info.value
    assert err.status == 507 and err.code == "vision_gate"
    assert err.details["needed"] == 7 * gib + 1 and err.details["pool_limit"] == 10 * gib
    assert "70%" in err.message and "vision_gate" in err.message
    with caplog.at_level(logging.WARNING):
        vision.enforce(warned)
    assert "t needs 9.0 GiB, 90% of the 10.0 GiB memory limit" in caplog.text


def test_settle_target_never_waits_for_more_than_comes_back() -> None:
    # The seed's switch: 13.5 GB model, wait for 1.5 x = 20 GB.
    assert settle_target(100, 1.5, before_available=10, freed=500) == 150
    assert settle_target(100, 1.5, before_available=10, freed=50) == 60
    assert settle_target(100, 0.0, before_available=10, freed=50) == 0
