"""`elbowroom pull` against a local stand-in for the Hugging Face Hub (tests/fakehub.py):
huggingface_hub's real client code talks HTTP to it (HF_ENDPOINT), the bundled SmolLM2 GGUF
is served from disk and a "70 GB" model's body is generated on demand. The fit check uses
this machine's real memory (SmolLM2 fits anywhere elbowroom runs; 70 GB fits nowhere here).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from bundled_models import bundled_spec
from fakehub import (
    FakeHub,
    Repo,
    big_gguf_header,
    bytes_blob,
    disk_blob,
    generated_blob,
    split_gguf,
)
from vision_gguf import write_projector

from elbowroom.config import Settings, load_settings
from elbowroom.errors import BadRequest, InsufficientMemory
from elbowroom.models.catalog import discover
from elbowroom.pull.fit import FITS, FITS_AT_CTX
from elbowroom.pull.puller import (
    ChecksumMismatch,
    GatedRepo,
    HubUnreachable,
    InsufficientStorage,
    NothingToServe,
    PullCancelled,
    Puller,
    RepoNotFound,
    UnknownQuant,
    parse_name,
    quant_of,
    remove_by_name,
)
from elbowroom.units import MiB

SMOL = "SmolLM2-135M-Instruct.Q4_1.gguf"
MACHINE = "16GiB"


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeHub]:
    head, size = big_gguf_header()
    huge_head, huge = big_gguf_header(total=400 * 10**12)  # 400 TB: no disk has room
    smol = disk_blob(bundled_spec("smollm2-135m").path)
    folder = tmp_path_factory.mktemp("hubfiles")
    proj = disk_blob(write_projector(folder / "mmproj.gguf"))
    shards = split_gguf(2)
    whisper = bundled_spec("whisper-tiny.en").path
    embed = bundled_spec("minilm-l6-v2")
    hub = FakeHub(
        {
            "test/faster-whisper-tiny.en": Repo(
                {
                    **{p.name: disk_blob(p) for p in sorted(whisper.iterdir()) if p.is_file()},
                    "README.md": bytes_blob(b"whisper"),
                }
            ),
            "test/minilm-onnx": Repo(
                {
                    "onnx/model.onnx": disk_blob(embed.path),
                    "onnx/model_O4.onnx": disk_blob(embed.path),
                    "tokenizer.json": disk_blob(Path(embed.options["tokenizer"])),
                    "config.json": bytes_blob(b"{}"),
                }
            ),
            "test/SmolLM2-GGUF": Repo(
                {
                    SMOL: smol,
                    "SmolLM2-135M-Instruct.F16.gguf": generated_blob(head, size),
                    "README.md": bytes_blob(b"# SmolLM2\n"),
                }
            ),
            "test/Big-70B-GGUF": Repo({"Big-70B.Q8_0.gguf": generated_blob(head, size)}),
            "test/Huge-GGUF": Repo({"Huge.Q2_K.gguf": generated_blob(huge_head, huge)}),
            "test/no-gguf": Repo(
                {
                    "README.md": bytes_blob(b"hi"),
                    "config.json": bytes_blob(b"{}"),
                    "model.safetensors": bytes_blob(b"\0" * 64, lfs=True),
                }
            ),
            "test/gated-GGUF": Repo({SMOL: smol}, gated=True),
            "test/vision-GGUF": Repo(
                {SMOL: smol, "mmproj-SmolLM2-F16.gguf": proj, "mmproj-SmolLM2-Q8_0.gguf": proj}
            ),
            "test/mixed-GGUF": Repo(
                {
                    "Mixed.Q4_1.gguf": smol,
                    "Mixed.Q2_K-00001-of-00002.gguf": bytes_blob(shards[0], lfs=True),
                    "Mixed.Q2_K-00002-of-00002.gguf": bytes_blob(shards[1], lfs=True),
                }
            ),
            "test/split-GGUF": Repo(
                {
                    "Tiny-Q8_0-00001-of-00002.gguf": bytes_blob(shards[0], lfs=True),
                    "Tiny-Q8_0-00002-of-00002.gguf": bytes_blob(shards[1], lfs=True),
                }
            ),
        }
    ).start()
    yield hub
    hub.stop()


@pytest.fixture
def settings(hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Settings]:
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "no-token"))
    hub.corrupt.clear()
    hub.log.clear()
    hub.sent.clear()
    # a machine of 16 GiB, wherever the tests run: SmolLM2 fits, 70 GB never does
    yield load_settings({"models_dir": tmp_path / "models", "override_memory": MACHINE}, environ={})


def _sent(hub: FakeHub, repo: str, name: str) -> int:
    return hub.sent.get(hub.repos[repo].files[name].sha256, 0)


def test_names_and_quants() -> None:
    assert parse_name("hf.co/bartowski/Qwen3-4B-GGUF:Q4_K_M").repo_id == "bartowski/Qwen3-4B-GGUF"
    assert parse_name("hf.co/bartowski/Qwen3-4B-GGUF:Q4_K_M").quant == "Q4_K_M"
    assert parse_name("https://huggingface.co/a/b").quant is None
    assert parse_name("a/b:latest").quant is None  # what Ollama clients add
    for bad in ("llama3", "a/../b", "a/b/c", "hf.co/"):
        with pytest.raises(BadRequest):
            parse_name(bad)
    assert quant_of("Qwen3-4B-Q4_K_M.gguf") == "Q4_K_M"
    assert quant_of(SMOL) == "Q4_1"
    assert quant_of("model-iq4_xs-00001-of-00003.gguf") == "IQ4_XS"
    assert quant_of("gemma-3-4b-it-BF16.gguf") == "BF16"
    assert quant_of("model.gguf") is None


def test_largest_quant_that_fits_is_picked_from_the_header_alone(
    hub: FakeHub, settings: Settings
) -> None:
    events: list[dict[str, object]] = []
    plan = Puller(settings, progress=events.append).plan("hf.co/test/SmolLM2-GGUF")
    assert plan.choice.quant == "Q4_1" and [f.path for f in plan.choice.files] == [SMOL]
    # the F16's 65 GiB are over any load ceiling here: refused by its size, never read
    assert "largest quant that fits" in plan.why and "F16" in plan.why, plan.why
    assert _sent(hub, "test/SmolLM2-GGUF", "SmolLM2-135M-Instruct.F16.gguf") == 0
    assert plan.fit is not None and plan.fit.verdict == FITS, plan.fit
    assert 0 < plan.header_bytes < 16 * MiB
    assert plan.header_bytes == _sent(hub, "test/SmolLM2-GGUF", SMOL)  # the count is true
    assert events[0] == {"status": "pulling manifest"} and len(events) == 2
    assert events[1]["status"] == f"fit check: {plan.fit.message}"
    assert events[1]["header_bytes_read"] == plan.header_bytes and events[1]["fit"] == FITS
    assert not (settings.models_path).exists()  # a plan downloads nothing


def test_70gb_model_is_refused_after_reading_its_header_only(
    hub: FakeHub, settings: Settings
) -> None:
    with pytest.raises(InsufficientMemory) as info:
        Puller(settings).plan("test/Big-70B-GGUF")
    err = info.value
    assert err.status == 507 and err.details["needed"] > 60 * 2**30, err.details
    assert err.details["fit_check"] == "never fits here" and err.details["largest_ctx"] == 0
    assert "smaller quant" in err.message and "needs" in err.message, err.message
    read = _sent(hub, "test/Big-70B-GGUF", "Big-70B.Q8_0.gguf")
    assert 0 < read < 16 * MiB
    assert not settings.models_path.exists()


def test_fits_only_at_a_smaller_context(hub: FakeHub, settings: Settings) -> None:
    # 16 slots of 8,192 tokens need ~3 GiB of KV; a 2 GiB machine holds a smaller context
    # (the override is charged with this process's own memory, which moves from test to
    # test: the numbers keep well clear of it)
    tight = load_settings(
        {
            "models_dir": settings.models_path,
            "override_memory": "2GiB",
            "ctx": 8192,
            "slots": 16,
        },
        environ={},
    )
    plan = Puller(tight).plan("test/SmolLM2-GGUF:Q4_1")
    assert plan.fit is not None and plan.fit.verdict == FITS_AT_CTX, plan.fit
    assert 0 < plan.fit.largest_ctx < 8192
    assert f"--ctx {plan.fit.largest_ctx}" in plan.fit.message
    # choosing: a smaller quant that fits as the settings are beats a larger one that
    # fits only at a smaller context
    mixed = Puller(tight).plan("test/mixed-GGUF")
    assert mixed.choice.quant == "Q2_K" and mixed.fit is not None, mixed.why
    assert mixed.fit.verdict == FITS
    # (its --ctx is this sample's: available memory moves between two samples on a shared
    # machine, and the limit follows it)
    assert re.search(r"Q4_1 fits only at --ctx \d+", mixed.why), mixed.why


def test_disk_space_is_checked_with_numbers(hub: FakeHub, settings: Settings) -> None:
    with pytest.raises(InsufficientMemory):  # 400 TB never fits: refused before the disk
        Puller(settings).plan("test/Huge-GGUF")
    with pytest.raises(InsufficientStorage) as info:  # --force: past the fit check
        Puller(settings).plan("test/Huge-GGUF", force=True)
    err = info.value
    assert err.status == 507 and err.details["needed"] > err.details["free"] > 0
    assert "free" in err.message and "HF_HUB_CACHE" in err.message


def test_errors_say_what_is_there(hub: FakeHub, settings: Settings) -> None:
    puller = Puller(settings)
    with pytest.raises(RepoNotFound) as nf:
        puller.plan("test/nothing-here")
    assert nf.value.status == 404 and "no model repository test/nothing-here" in nf.value.message
    with pytest.raises(NothingToServe) as none:
        puller.plan("test/no-gguf")
    assert "model.safetensors" in none.value.message and "config.json" in none.value.message
    with pytest.raises(UnknownQuant) as uq:
        puller.plan("test/SmolLM2-GGUF:Q5_K_M")
    assert uq.value.status == 400
    assert "its quants: F16, Q4_1" in uq.value.message, uq.value.message
    with pytest.raises(RepoNotFound) as rev:
        puller.plan("test/SmolLM2-GGUF", revision="v9")
    assert "revision" in rev.value.message
    with pytest.raises(GatedRepo) as gated:
        puller.plan("test/gated-GGUF")
    assert gated.value.status == 403 and "HF_TOKEN" in gated.value.message
    # with the token the gated repository opens
    plan = Puller(settings, token=hub.token).plan("test/gated-GGUF")
    assert plan.choice.quant == "Q4_1"


def test_network_down_is_a_503(hub: FakeHub, settings: Settings) -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(HubUnreachable) as info:
        Puller(settings, endpoint=f"http://127.0.0.1:{port}").plan("test/SmolLM2-GGUF")
    assert info.value.status == 503 and "cannot reach" in info.value.message


def test_pull_verifies_installs_and_rm_deletes(hub: FakeHub, settings: Settings) -> None:
    events: list[dict[str, object]] = []
    result = Puller(settings, progress=events.append).pull("test/SmolLM2-GGUF:Q4_1")
    statuses = [e["status"] for e in events]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    assert statuses.index("verifying sha256 digest") > statuses.index("downloading " + SMOL)
    last = [e for e in events if e["status"] == "downloading " + SMOL][-1]
    sha = hub.repos["test/SmolLM2-GGUF"].files[SMOL].sha256
    assert last == {
        "status": "downloading " + SMOL,
        "digest": f"sha256:{sha}",
        "total": result.plan.total,
        "completed": result.plan.total,
    }
    assert result.model_id == "smollm2-135m-instruct.q4_1"
    link = settings.models_path / "hf.co" / "test" / "SmolLM2-GGUF" / SMOL
    assert result.path == link and link.is_symlink()
    blob = link.resolve()
    assert blob.parent.name == "blobs" and blob.name == sha  # huggingface_hub's layout
    spec = discover(settings).get("smollm2-135m-instruct.q4_1")
    assert spec.size_bytes == result.plan.total and spec.gguf is not None
    # a second pull downloads nothing
    again = Puller(settings).pull("test/SmolLM2-GGUF:Q4_1")
    assert again.downloaded == 0 and again.model_id == result.model_id
    removed = remove_by_name(settings, discover(settings), "hf.co/test/SmolLM2-GGUF")
    assert [r.model_id for r in removed] == [result.model_id]
    assert removed[0].freed == result.plan.total
    assert not link.exists() and not blob.exists()
    assert "smollm2-135m-instruct.q4_1" not in discover(settings)
    with pytest.raises(BadRequest, match="not pulled by elbowroom"):
        remove_by_name(settings, discover(settings), "smollm2-135m")  # a bundled model


def test_corrupt_byte_is_caught_and_nothing_is_left(hub: FakeHub, settings: Settings) -> None:
    sha = hub.repos["test/SmolLM2-GGUF"].files[SMOL].sha256
    hub.corrupt.add(sha)
    with pytest.raises(ChecksumMismatch) as info:
        Puller(settings).pull("test/SmolLM2-GGUF:Q4_1")
    assert "corrupt" in info.value.message and info.value.details["expected"] == sha
    cache = [p for p in (settings.models_path.parent / "hf").rglob("*") if p.is_file()]
    assert [p.name for p in cache if "blobs" in p.parts] == []  # no partial, no blob
    assert not (settings.models_path / "hf.co" / "test" / "SmolLM2-GGUF" / SMOL).exists()
    hub.corrupt.clear()
    assert Puller(settings).pull("test/SmolLM2-GGUF:Q4_1").model_id is not None


def test_cancelled_pull_resumes_where_it_stopped(hub: FakeHub, settings: Settings) -> None:
    puller = Puller(settings)

    def stop_at_40_mib(event: dict[str, object]) -> None:
        if int(str(event.get("completed", 0))) >= 40 * MiB:
            puller.cancel.set()

    puller.progress = stop_at_40_mib
    with pytest.raises(PullCancelled):
        puller.pull("test/SmolLM2-GGUF:Q4_1")
    link = settings.models_path / "hf.co" / "test" / "SmolLM2-GGUF" / SMOL
    assert not link.exists()  # a partial file is never visible to the catalog
    assert "smollm2-135m-instruct.q4_1" not in discover(settings)
    hub.log.clear()
    result = Puller(settings).pull("test/SmolLM2-GGUF:Q4_1")
    assert result.resumed >= 40 * MiB and result.downloaded + result.resumed == result.plan.total
    ranges = [r for m, p, r in hub.log if m == "GET" and p.startswith("/cdn/") and r]
    assert f"bytes={result.resumed}-" in ranges, hub.log


def test_vision_projector_and_split_models(hub: FakeHub, settings: Settings) -> None:
    result = Puller(settings).pull("test/vision-GGUF")
    assert result.plan.choice.projector is not None
    assert result.plan.choice.projector.path == "mmproj-SmolLM2-F16.gguf"  # F16 preferred
    assert "vision projector" in result.plan.why
    spec = discover(settings).get(str(result.model_id))
    assert spec.vision and spec.projector is not None
    assert result.plan.fit is not None and result.plan.fit.ok

    split = Puller(settings).pull("test/split-GGUF")
    assert [f.path for f in split.plan.choice.files] == [
        "Tiny-Q8_0-00002-of-00002.gguf",
        "Tiny-Q8_0-00001-of-00002.gguf",  # the first shard, which lists the model, last
    ]
    spec = discover(settings).get(str(split.model_id))
    assert spec.size_bytes == split.plan.total
    removed = remove_by_name(settings, discover(settings), str(split.model_id))
    assert len(removed[0].paths) == 2
    assert not list((settings.models_path / "hf.co" / "test").glob("split-GGUF"))


def test_cli_pull_json_and_check(
    hub: FakeHub, settings: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from elbowroom.cli import main

    models = str(settings.models_path)
    assert (
        main(
            [
                "pull",
                "test/Big-70B-GGUF",
                "--json",
                "--models-dir",
                models,
                "--override-memory",
                MACHINE,
            ]
        )
        == 1
    )
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert lines[0] == {"status": "pulling manifest"}
    assert lines[-1]["status"] == 507 and lines[-1]["code"] == "insufficient_memory"
    assert (
        main(
            [
                "pull",
                "test/SmolLM2-GGUF",
                "--check",
                "--models-dir",
                models,
                "--override-memory",
                MACHINE,
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert "fit check: fits" in err and "largest quant that fits" in err, err
    assert not settings.models_path.exists()


def test_whisper_folder_and_onnx_embedder(hub: FakeHub, settings: Settings) -> None:
    asr = Puller(settings).pull("test/faster-whisper-tiny.en")
    assert asr.plan.choice.anchor == "model.bin" and asr.plan.choice.files[-1].path == "model.bin"
    assert "README.md" not in [f.path for f in asr.plan.choice.files]
    assert asr.plan.fit is not None and asr.plan.fit.verdict == FITS
    spec = discover(settings).get(str(asr.model_id))
    assert (
        spec.kind == "asr" and spec.engine == "whisper" and asr.model_id == "faster-whisper-tiny.en"
    )

    emb = Puller(settings).pull("test/minilm-onnx")
    assert [f.path for f in emb.plan.choice.files] == [
        "tokenizer.json",
        "config.json",
        "onnx/model.onnx",  # only the one the engine loads, last
    ]
    spec = discover(settings).get(str(emb.model_id))
    assert spec.kind == "embedding" and spec.engine == "onnx-embed"
    removed = remove_by_name(settings, discover(settings), "test/minilm-onnx")
    assert removed[0].freed == emb.plan.total
    assert not (settings.models_path / "hf.co" / "test" / "minilm-onnx").exists()


def test_cli_rm(hub: FakeHub, settings: Settings, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from elbowroom.cli import main

    pulled = Puller(settings).pull("test/SmolLM2-GGUF:Q4_1")
    models = str(settings.models_path)
    assert (
        main(["rm", "smollm2-135m", "--models-dir", models, "--override-memory", MACHINE]) == 1
    )  # bundled: not ours
    assert "not pulled by elbowroom" in capsys.readouterr().err
    assert (
        main(
            [
                "rm",
                str(pulled.model_id),
                "--json",
                "--models-dir",
                models,
                "--override-memory",
                MACHINE,
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["deleted"][0]["model"] == pulled.model_id
    assert out["deleted"][0]["freed"] == pulled.plan.total
    assert (
        main(["rm", str(pulled.model_id), "--models-dir", models, "--override-memory", MACHINE])
        == 1
    )
    assert "no model" in capsys.readouterr().err


def test_header_reads_grow_by_doubling(hub: FakeHub, gemma_settings: Settings | None) -> None:
    """The numbers docs/pull.md gives: SmolLM2's header in 2 MiB (2 requests), gemma3's
    262,144-token vocabulary in 8 MiB (4 requests); each read only asks for what is new."""
    from huggingface_hub import get_session

    from elbowroom.pull.remote_gguf import RangeReader

    blobs = [("smollm2", hub.repos["test/SmolLM2-GGUF"].files[SMOL], 2 * MiB, 2)]
    if gemma_settings is not None:
        gemma = disk_blob(bundled_spec("gemma3-270m", gemma_settings).path)
        hub.repos["test/gemma"] = Repo({"gemma.gguf": gemma})
        blobs.append(("gemma3", gemma, 8 * MiB, 4))
    for name, blob, read, requests in blobs:
        hub.log.clear()
        reader = RangeReader(get_session())
        header = reader.header(f"{hub.url}/cdn/{blob.sha256}", blob.size, name)
        assert header.tensors and (reader.bytes_read, reader.requests) == (read, requests)
        ranges = [r for _m, _p, r in hub.log]
        assert ranges[0] == "bytes=0-1048575" and ranges[1] == "bytes=1048576-2097151"


def test_network_down_midway_keeps_the_part_for_later(hub: FakeHub, settings: Settings) -> None:
    """The connection is cut at 40 MiB and stays down: huggingface_hub's http_get retries (a
    few seconds), then the pull is a 503; nothing is installed, the partial file is kept,
    and the next pull, with the network back, resumes it."""
    puller = Puller(settings)

    def cut_at_40_mib(event: dict[str, object]) -> None:
        if int(str(event.get("completed", 0))) >= 40 * MiB:
            hub.down = True

    puller.progress = cut_at_40_mib
    try:
        with pytest.raises(HubUnreachable) as info:
            puller.pull("test/SmolLM2-GGUF:Q4_1")
    finally:
        hub.down = False
    assert info.value.status == 503 and SMOL in info.value.message
    assert "smollm2-135m-instruct.q4_1" not in discover(settings)
    result = Puller(settings).pull("test/SmolLM2-GGUF:Q4_1")
    assert result.resumed >= 40 * MiB and result.model_id == "smollm2-135m-instruct.q4_1"
