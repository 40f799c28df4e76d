"""Vision end to end: a real ``elbowroom serve``, the real engine with a real projector.

No vision-language model can be downloaded here, so the module makes one: the bundled
SmolLM2-135M (a copy named ``smolvlm-test.gguf``) beside ``mmproj-smolvlm-test.gguf``, a
genuine gemma3-type projector with random weights (tests/vision_gguf.py). Images go through
the real encoder, the real memory and the real request path; the words that come out are
meaningless, so the tests assert statuses, token counts and bytes.
"""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ollama
import openai
import pytest
from bundled_models import bundled_spec
from serverproc import ServerFactory, ServerProcess, runner_pid
from vision_gguf import bomb_png, image_tokens, write_projector

from elbowroom.config import load_settings
from elbowroom.memory.process import measure_pid
from elbowroom.models.catalog import discover
from elbowroom.models.estimate import footprint
from elbowroom.units import MiB

pytestmark = pytest.mark.slow

VLM, TEXT = "smolvlm-test", "smollm2-135m"
PER_IMAGE = image_tokens()  # 256


def make_models(folder: Path) -> Path:
    """The test vision model: a copy (hard link when possible) of the bundled SmolLM2 and a
    random projector beside it. A symlink would not do: discovery lists a file once, and
    the bundled package already lists SmolLM2 as a text model."""
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"{VLM}.gguf"
    src = bundled_spec(TEXT).path
    try:
        os.link(src, target)
    except OSError:
        shutil.copyfile(src, target)
    write_projector(folder / f"mmproj-{VLM}.gguf")
    return folder


def picture(fmt: str, size: tuple[int, int] = (320, 240)) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(1).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, fmt)
    return buf.getvalue()


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def chat(text: str, *urls: str) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": parts}]


@dataclass
class Vision:
    server: ServerProcess
    models: Path
    loaded: dict[str, Any]  # the ps row right after load
    predicted_working: int  # the part of the prediction that appears with the first image


@pytest.fixture(scope="module")
def vision(
    server_factory: ServerFactory, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Vision]:
    home = tmp_path_factory.mktemp("vision")
    models = make_models(home / "models")
    env = {"ELBOWROOM_KV_RAM_MAX": "0", "ELBOWROOM_MODELS_DIR": str(models)}
    server = server_factory("--ctx", "1024", "--slots", "2", home=home, env=env)
    with server.http() as http:
        r = http.post(f"/api/models/{VLM}/load")
        assert r.status_code == 200, r.text
    row = next(r for r in server.ps() if r["id"] == VLM)
    settings = load_settings(environ={"ELBOWROOM_MODELS_DIR": str(models)})
    spec = discover(settings).get(VLM)
    fp = footprint(spec, row["n_ctx"], row["slots"], row["kv_type"])
    assert fp.total == row["predicted"], (fp, row)  # the server planned what we compute
    yield Vision(server, models, row, fp.working)


def test_models_list_the_vision_capability(vision: Vision) -> None:
    cards = {m.id: m for m in vision.server.openai().models.list().data}
    assert "vision" in (cards[VLM].model_extra or {})["capabilities"]
    assert "vision" not in (cards[TEXT].model_extra or {})["capabilities"]
    # `elbowroom ls` reads the catalog itself.
    env = {**os.environ, "ELBOWROOM_MODELS_DIR": str(vision.models)}
    ls = subprocess.run(
        [sys.executable, "-m", "elbowroom", "ls", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert ls.returncode == 0, ls.stderr
    rows = {m["id"]: m for m in json.loads(ls.stdout)["models"]}
    assert "vision" in rows[VLM]["capabilities"] and rows[VLM]["projector"]["image_tokens"] == 256
    assert rows[TEXT]["projector"] is None
    table = subprocess.run(
        [sys.executable, "-m", "elbowroom", "ls"], capture_output=True, text=True, env=env
    )
    assert any(VLM in line and "llm +vision" in line for line in table.stdout.splitlines())
    plan = subprocess.run(
        [sys.executable, "-m", "elbowroom", "plan", VLM, "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert plan.returncode == 0, plan.stderr
    seen = json.loads(plan.stdout)["vision"]
    assert seen["image_tokens"] == PER_IMAGE and seen["working"] > 0
    assert seen["gate"]["vision_gate"] == 0.70 and seen["gate"]["verdict"] in ("ok", "refuse")


def test_chat_with_png_and_jpeg_counts_the_image_tokens(vision: Vision) -> None:
    client = vision.server.openai()
    png, jpeg = picture("PNG"), picture("JPEG")
    plain = client.chat.completions.create(
        model=VLM, messages=chat("Describe the pictures."), max_tokens=4
    )
    both = client.chat.completions.create(
        model=VLM,
        messages=chat(
            "Describe the pictures.", data_url(png, "image/png"), data_url(jpeg, "image/jpeg")
        ),
        max_tokens=4,
    )
    assert both.choices[0].finish_reason in ("stop", "length")
    assert plain.usage is not None and both.usage is not None
    added = both.usage.prompt_tokens - plain.usage.prompt_tokens
    # Each image is PER_IMAGE embeddings plus its begin/end markers (a few text tokens).
    assert 2 * PER_IMAGE <= added <= 2 * PER_IMAGE + 32, (plain.usage, both.usage)
    # Streaming too, with usage: relayed straight from the engine (server/direct.py).
    direct = next(r for r in vision.server.ps() if r["id"] == VLM)["engine_stats"]
    chunks = list(
        client.chat.completions.create(
            model=VLM,
            messages=chat("And now?", data_url(png, "image/png")),
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = [c.usage for c in chunks if c.usage is not None]
    assert usage and usage[-1].prompt_tokens >= PER_IMAGE
    after = next(r for r in vision.server.ps() if r["id"] == VLM)["engine_stats"]
    assert after["socket_streams"]["all"] == direct["socket_streams"]["all"] + 1


def test_footprint_predicted_vs_measured_with_and_without_an_image(vision: Vision) -> None:
    """±10 %: right after load against the prediction less what appears with the first
    image; after images have been encoded against the whole prediction."""
    row = vision.loaded
    at_load = row["predicted"] - vision.predicted_working
    measured_load = row["anonymous"] + row["file_backed"]
    client = vision.server.openai()
    client.chat.completions.create(
        model=VLM, messages=chat("Look.", data_url(picture("PNG"), "image/png")), max_tokens=2
    )
    pid = runner_pid(vision.server, VLM)
    assert pid is not None
    after = measure_pid(pid)
    measured_image = after.anonymous + after.file_backed
    print(
        f"\nvision footprint: at load predicted {at_load / MiB:.1f} MiB, measured "
        f"{measured_load / MiB:.1f} MiB; with images predicted {row['predicted'] / MiB:.1f} "
        f"MiB, measured {measured_image / MiB:.1f} MiB"
    )
    assert abs(measured_load - at_load) <= 0.10 * at_load, (measured_load, at_load)
    assert abs(measured_image - row["predicted"]) <= 0.10 * row["predicted"]


def test_remote_urls_are_refused(vision: Vision) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        vision.server.openai().chat.completions.create(
            model=VLM, messages=chat("Look.", "http://127.0.0.1:9/cat.png"), max_tokens=2
        )
    err = info.value.body
    assert isinstance(err, dict) and err["code"] == "remote_image_url", err
    assert err["param"] == "messages[0].content[1].image_url.url"


def test_bombs_and_non_images_are_refused_fast_without_memory(vision: Vision) -> None:
    server, client = vision.server, vision.server.openai()
    pid = runner_pid(server, VLM)
    assert pid is not None
    runner_before = measure_pid(pid).anonymous
    server_before = server.memory()["server_usage"]
    bomb = bomb_png()
    assert len(bomb) < 1 * MiB
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(
            model=VLM, messages=chat("Look.", data_url(bomb, "image/png")), max_tokens=2
        )
    assert info.value.status_code == 413
    assert isinstance(info.value.body, dict) and info.value.body["code"] == "image_too_large"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model=VLM,
            messages=chat("Look.", data_url(b"this is not an image at all", "image/png")),
            max_tokens=2,
        )
    assert isinstance(bad.value.body, dict) and bad.value.body["code"] == "invalid_image"
    with pytest.raises(openai.BadRequestError) as b64:
        client.chat.completions.create(
            model=VLM, messages=chat("Look.", "data:image/png;base64,%%%not-base64"), max_tokens=2
        )
    assert isinstance(b64.value.body, dict) and b64.value.body["code"] == "invalid_image"
    assert time.monotonic() - started < 5.0  # refused from the header, nothing decoded
    # Nothing reached the runner, and the server did not decode 400 million pixels.
    assert abs(measure_pid(pid).anonymous - runner_before) < 4 * MiB
    assert server.memory()["server_usage"] - server_before < 32 * MiB


def test_text_model_refuses_images(vision: Vision) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        vision.server.openai().chat.completions.create(
            model=TEXT,
            messages=chat("Look.", data_url(picture("PNG"), "image/png")),
            max_tokens=2,
        )
    err = info.value.body
    assert isinstance(err, dict) and err["code"] == "model_not_supported", err
    assert "vision" in err["message"]


def test_ollama_images(vision: Vision) -> None:
    client = ollama.Client(host=vision.server.url, timeout=180)
    png = picture("PNG")
    out = client.chat(
        model=VLM,
        messages=[{"role": "user", "content": "What is it?", "images": [png]}],
        options={"num_predict": 2},
        stream=False,
    )
    assert (out.prompt_eval_count or 0) >= PER_IMAGE
    assert "vision" in (client.show(VLM).capabilities or [])
    assert "vision" not in (client.show(TEXT).capabilities or [])
    gen = client.generate(model=VLM, prompt="What is it?", images=[png], options={"num_predict": 2})
    assert (gen.prompt_eval_count or 0) >= PER_IMAGE
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(
            model=TEXT,
            messages=[{"role": "user", "content": "What is it?", "images": [png]}],
            stream=False,
        )
    assert info.value.status_code == 400


# --- the vision gate ----------------------------------------------------------------------

RESERVE = 512 * MiB
SLOTS, CTX = 4, 8192  # SmolLM2's trained context: ~0.9 GiB, mostly KV


def gate_limit(vision: Vision) -> tuple[int, int, int]:
    """A memory limit where the text model is above 70 % and still fits the load ceiling
    (with the server's own bytes), so the vision model, a little larger, is above it too.
    Returns (limit, text footprint, vision footprint), predicted as the server will."""
    settings = load_settings(environ={"ELBOWROOM_MODELS_DIR": str(vision.models)})
    catalog = discover(settings)
    text = footprint(catalog.get(TEXT), CTX, SLOTS, "f16").total
    seeing = footprint(catalog.get(VLM), CTX, SLOTS, "f16").total
    own = int(vision.server.memory()["server_usage"]) + 48 * MiB  # a fresh server, some slack
    low, high = int((text + own) / settings.load_fraction), int(text / settings.vision_gate)
    if low >= high:
        pytest.skip(f"no limit puts {text} bytes above the gate and under the ceiling")
    return (low + high) // 2, text, seeing


def gated_server(
    server_factory: ServerFactory, vision: Vision, limit: int, *args: str, **extra: str
) -> ServerProcess:
    env = {
        **extra,
        "ELBOWROOM_KV_RAM_MAX": "0",
        "ELBOWROOM_MODELS_DIR": str(vision.models),
        "ELBOWROOM_OVERRIDE_MEMORY": str(limit + RESERVE),
        "ELBOWROOM_CONTAINER_MARGIN": str(RESERVE),
    }
    server = server_factory("--slots", str(SLOTS), *args, env=env)
    assert server.memory()["limit"]["value"] == limit
    return server


def test_vision_gate_refuses_the_vision_model_and_warns_for_text(
    server_factory: ServerFactory, vision: Vision
) -> None:
    limit, text, seeing = gate_limit(vision)
    server = gated_server(server_factory, vision, limit, "--ctx", str(CTX))
    client = server.openai()
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model=VLM, messages=chat("Hi"), max_tokens=2)
    assert info.value.status_code == 507
    err = info.value.body
    assert isinstance(err, dict) and err["code"] == "vision_gate" and err["model"] == VLM, err
    assert err["needed"] == seeing and err["pool_limit"] == limit
    assert err["vision_gate"] == 0.70 and err["share"] > 0.70
    assert "70%" in err["message"] and "vision_gate" in err["message"]
    assert server.ps() == []
    # The text model of (nearly) the same size: loaded, with a warning in the log.
    out = client.chat.completions.create(model=TEXT, messages=chat("Hi"), max_tokens=2)
    assert out.choices[0].message.content is not None
    assert text > 0.70 * limit
    print(
        f"\nvision gate: limit {limit / MiB:.0f} MiB, vision model {seeing / MiB:.0f} MiB "
        f"({seeing / limit:.0%}): 507; text model {text / MiB:.0f} MiB ({text / limit:.0%}): "
        "loaded with a warning"
    )
    assert f"{TEXT} needs" in server.log() and "vision gate is 70%" in server.log()


def test_auto_sized_vision_context_stays_inside_the_gate(
    server_factory: ServerFactory, vision: Vision
) -> None:
    limit, _text, _seeing = gate_limit(vision)
    # Auto-sizing may go up to the trained context, where the footprint is above the gate.
    server = gated_server(server_factory, vision, limit, ELBOWROOM_MAX_CTX=str(CTX))
    client = server.openai()
    out = client.chat.completions.create(
        model=VLM, messages=chat("Look.", data_url(picture("PNG"), "image/png")), max_tokens=2
    )
    assert out.usage is not None and out.usage.prompt_tokens >= PER_IMAGE
    row = next(r for r in server.ps() if r["id"] == VLM)
    assert row["predicted"] <= 0.70 * limit, (row, limit)
    assert row["n_ctx"] < CTX  # sized inside the gate, not to the load ceiling


def test_images_that_cannot_fit_the_context_are_400_before_the_engine(vision: Vision) -> None:
    png = data_url(picture("PNG", (64, 64)), "image/png")
    with pytest.raises(openai.BadRequestError) as info:  # 4 x 256 tokens in --ctx 1024
        vision.server.openai().chat.completions.create(
            model=VLM, messages=chat("Look.", png, png, png, png), max_tokens=2
        )
    err = info.value.body
    assert isinstance(err, dict) and err["code"] == "context_length_exceeded", err
    assert err["image_tokens"] == 4 * PER_IMAGE and err["n_ctx"] == 1024
