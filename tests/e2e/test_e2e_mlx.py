"""MLX models through a real server and the official openai and ollama clients (mlx[cpu]).

The models folder holds SmolLM2-135M converted from the bundled GGUF (real text) and a tiny
random-weight 4-bit llama (the mechanics, fast). The bundled SmolLM2 GGUF is there too, so
an MLX model and a GGUF model compete for the same bytes.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest
from mlx_models import have_mlx, random_mlx, smollm2_mlx
from serverproc import REPO, ServerFactory, ServerProcess, runner_pid, wait_for

from elbowroom.config import Settings
from elbowroom.units import MiB

if (why := have_mlx()) is not None:
    pytest.skip(why, allow_module_level=True)

pytestmark = pytest.mark.slow

SMOL_MLX, TINY, GGUF = "smollm2-mlx", "tiny-mlx", "smollm2-135m"
HI = [{"role": "user", "content": "Hi"}]
RESERVE = 512 * MiB
NO_GRANT = {"ELBOWROOM_KV_RAM_MAX": "0"}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mlx-models")
    smollm2_mlx(root / SMOL_MLX)
    random_mlx(root / TINY, layers=2, hidden=64, bits=4, group_size=32)
    return root


@pytest.fixture(scope="module")
def server(server_factory: ServerFactory, models: Path) -> ServerProcess:
    return server_factory("--ctx", "1024", "--models-dir", str(models))


def stats(server: ServerProcess, model: str) -> dict[str, Any]:
    rows = {
        r["name"].removesuffix(":latest"): r for r in server.http().get("/api/ps").json()["models"]
    }
    return dict(rows[model].get("engine_stats") or {}) if model in rows else {}


def test_ls_lists_mlx_models_with_their_predicted_footprint(models: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "elbowroom", "ls", "--json", "--models-dir", str(models)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    rows = {r["id"]: r for r in json.loads(out.stdout)["models"]}
    for model in (SMOL_MLX, TINY):
        assert rows[model]["engine"] == "mlx" and rows[model]["kind"] == "llm", rows[model]
    assert GGUF in rows  # listed side by side


def test_openai_chat_gives_real_text(server: ServerProcess) -> None:
    out = server.openai().chat.completions.create(
        model=SMOL_MLX,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=8,
        temperature=0,
    )
    assert "Paris" in (out.choices[0].message.content or ""), out
    assert out.usage is not None and out.usage.completion_tokens <= 8


def test_ollama_streams_chat(server: ServerProcess) -> None:
    client = ollama.Client(host=server.url)
    pieces = []
    for part in client.chat(
        model=TINY,
        messages=HI,
        stream=True,
        options={"num_predict": 6, "temperature": 0},
    ):
        pieces.append(part)
    assert pieces[-1].done and pieces[-1].eval_count == 6
    assert len(pieces) >= 2  # streamed, not one answer


def test_openai_stream_cancel_stops_the_generation(server: ServerProcess) -> None:
    client = server.openai()
    client.completions.create(model=TINY, prompt="warm", max_tokens=1)  # loaded
    before = stats(server, TINY)["tokens_generated"]
    stream = client.completions.create(
        model=TINY, prompt="Count: 1, 2, 3,", max_tokens=900, temperature=0, stream=True
    )
    for got, _chunk in enumerate(stream, 1):
        if got == 3:
            break
    stream.close()  # the client goes away mid-stream
    wait_for(
        lambda: stats(server, TINY).get("slots_busy") == 0,
        timeout=60,
        what="the cancelled generation to end",
    )
    generated = stats(server, TINY)["tokens_generated"] - before
    assert generated < 900, generated  # cancelled, not run to max_tokens
    again = client.completions.create(model=TINY, prompt="Hi", max_tokens=2)
    assert again.usage is not None and again.usage.completion_tokens == 2


def test_unsupported_fields_are_clear_400s(server: ServerProcess) -> None:
    client = server.openai()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=TINY,
            messages=HI,
            max_tokens=2,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object"}},
            },
        )
    assert "response_format" in str(info.value)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=TINY,
            messages=HI,
            max_tokens=2,
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        )
    with pytest.raises(ollama.ResponseError) as err:
        ollama.Client(host=server.url).chat(model=TINY, messages=HI, format="json")
    assert err.value.status_code == 400


def test_ps_and_metrics_report_mlx_memory(server: ServerProcess) -> None:
    server.openai().completions.create(model=TINY, prompt="Hi", max_tokens=2)
    mem = stats(server, TINY)["mlx"]
    assert mem["active"] > 0 and mem["peak"] >= mem["active"] and mem["memory_limit"] > 0
    assert mem["cache"] == 0  # emptied after each request
    text = server.http().get("/metrics").text
    assert f'elbowroom_mlx_memory_bytes{{kind="active",model="{TINY}"}}' in text


def test_disk_tier_survives_a_restart(
    server_factory: ServerFactory, models: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    home = tmp_path_factory.mktemp("mlx-restart")
    prompt = "A preamble long enough for several cache blocks. " * 30
    first = server_factory("--ctx", "1024", "--models-dir", str(models), home=home)
    out1 = first.openai().completions.create(model=TINY, prompt=prompt, max_tokens=3, temperature=0)
    first.stop()  # graceful: the runner saves its slot's state to the disk tier
    second = server_factory("--ctx", "1024", "--models-dir", str(models), home=home)
    out2 = second.openai().completions.create(
        model=TINY, prompt=prompt, max_tokens=3, temperature=0
    )
    assert out2.usage is not None and out2.usage.prompt_tokens_details is not None
    assert (out2.usage.prompt_tokens_details.cached_tokens or 0) >= 256
    assert out1.choices[0].text == out2.choices[0].text
    assert stats(second, TINY)["kv_cache"]["hits"]["disk"] == 1


@pytest.fixture(scope="module")
def measured(
    server_factory: ServerFactory, models: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Path, dict[str, int], int]]:
    """Both models' measured bytes, in a data folder a limited server then shares."""
    home = tmp_path_factory.mktemp("mlx-measured")
    server = server_factory("--ctx", "1024", "--models-dir", str(models), home=home, env=NO_GRANT)
    sizes = {}
    with server.http() as http:
        for model in (TINY, GGUF):
            r = http.post(f"/api/models/{model}/load")
            assert r.status_code == 200, r.text
            sizes[model] = int(r.json()["runner"]["bytes"])
    own = int(server.memory()["server_usage"])
    server.stop()
    yield home, sizes, own


def limited(server_factory: ServerFactory, home: Path, models: Path, limit: int) -> ServerProcess:
    return server_factory(
        "--ctx",
        "1024",
        "--models-dir",
        str(models),
        home=home,
        env={
            **NO_GRANT,
            "ELBOWROOM_OVERRIDE_MEMORY": str(limit + RESERVE),
            "ELBOWROOM_CONTAINER_MARGIN": str(RESERVE),
        },
    )


def test_an_mlx_model_and_a_gguf_model_evict_each_other_by_bytes(
    server_factory: ServerFactory, models: Path, measured: tuple[Path, dict[str, int], int]
) -> None:
    home, sizes, own = measured
    small, big = sorted(sizes.values())
    soft = Settings().load_fraction
    low, high = int((big + own) / soft) + 16 * MiB, int((small + big + own) / soft) - 16 * MiB
    if low >= high:
        pytest.skip(f"footprints {sizes} leave no limit that fits one but not both")
    server = limited(server_factory, home, models, (low + high) // 2)
    client = server.openai()
    pids = []
    for model in (TINY, GGUF, TINY):
        out = client.chat.completions.create(model=model, messages=HI, max_tokens=2)
        assert out.choices[0].message.content is not None
        rows = server.ps()
        assert [r["id"] for r in rows] == [model], rows  # the other one was evicted
        pids.append(runner_pid(server, model))
    assert len(set(pids)) == 3  # every switch was an unload and a fresh load


def test_an_mlx_model_that_cannot_fit_is_507_with_numbers(
    server_factory: ServerFactory, models: Path, measured: tuple[Path, dict[str, int], int]
) -> None:
    home, _sizes, own = measured
    server = limited(server_factory, home, models, 2 * own + 16 * MiB)
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": TINY, "messages": HI, "max_tokens": 2},
        timeout=120,
    )
    assert r.status_code == 507, r.text
    err = r.json()["error"]
    assert err["model"] == TINY and err["needed"] > err["available"]
    for key in ("needed", "available", "limit", "suggestions"):
        assert key in err, err
    assert server.ps() == []


COUNT = "Write the numbers from 1 to 900, separated by commas: 1, 2, 3,"


def test_hard_pressure_aborts_an_mlx_stream_within_16_tokens(
    tmp_path_factory: pytest.TempPathFactory, models: Path
) -> None:
    """The guard of test_pressure.py on its fake machine (the probe is the edge; our bytes
    are measured for real): memory turns hard mid-stream, the runner stops before its next
    token, the openai client gets the documented mid-stream ``memory_pressure`` error, and
    the model serves again once pressure has passed. SmolLM2 (real text, ~3 tok/s on this
    CPU) so the guard's 0.1 s sampling is a small part of 16 tokens."""
    from test_pressure import FakeMachine, InProcessServer

    machine = FakeMachine()
    home = tmp_path_factory.mktemp("mlx-pressure")
    settings = Settings(
        data_dir=home / "data",
        kv_cache_dir=home / "kv",
        models_dir=models,
        ctx=1024,
        keep_alive=3600,
        resident_idle=3600,
        monitor_interval=0.1,
        safety_margin=machine.margin,
        preload=(SMOL_MLX,),
    )
    server = InProcessServer(settings, machine).start()
    try:
        wait_for(lambda: server.loaded() == {SMOL_MLX}, timeout=300, what="the MLX model")
        client = server.openai()
        stream = client.completions.create(
            model=SMOL_MLX, prompt=COUNT, max_tokens=120, temperature=0, stream=True
        )
        pieces: list[str] = []
        squeezed_at = -1
        with pytest.raises(openai.APIError) as info:
            for chunk in stream:
                pieces.append(chunk.choices[0].text)
                if len(pieces) == 3:
                    squeezed_at = len(pieces)
                    machine.squeeze(1.2)  # our usage 120 % of the limit: hard
        err = info.value
        assert isinstance(err.body, dict) and err.body.get("type") == "memory_pressure", err.body
        found = re.search(r"after (\d+) tokens", str(err.body.get("message")))
        assert found is not None, err.body
        # Tokens generated in all minus the pieces the client had read when memory turned
        # hard (pieces trail tokens, so this over-counts, never under).
        assert 0 <= int(found.group(1)) - squeezed_at <= 16, (found.group(0), squeezed_at)
        abort = server.events("abort")[0]
        assert abort["model"] == SMOL_MLX and "newest generation" in abort["message"]

        refused = httpx.post(
            server.url + "/v1/completions",
            json={"model": SMOL_MLX, "prompt": "Hi", "max_tokens": 2},
            timeout=60,
        )
        assert refused.status_code == 503, refused.text  # while hard: no new work
        assert refused.json()["error"]["type"] == "memory_pressure"

        machine.others = 0
        wait_for(lambda: server.guard()["admission_open"], timeout=60, what="admission")
        out = client.chat.completions.create(
            model=SMOL_MLX,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=8,
            temperature=0,
        )
        assert "Paris" in (out.choices[0].message.content or ""), out
    finally:
        server.stop()
