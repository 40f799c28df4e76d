"""A real 800 MiB cgroup v1 with a 200 MB neighbour: both bundled LLMs load, one at a time.

Before this, the container got the host's tiered OS reserve (half of 800 MiB) and a 340 MiB
load ceiling, and gemma3-270m was refused. Now the limit keeps a container margin and the
neighbour comes off through the `available` candidate. `elbowroom plan` runs inside the
cgroup for each model (its output is printed: run pytest with -s to see it), then a real
server in the cgroup serves each model through the openai client, the other unloaded first.
Nothing may be OOM-killed, and each runner's measured bytes are compared with its plan.

gemma3-270m runs with 2 slots here (``model_slots``, for the plan and the server alike): at
the default 4 its footprint in use at the 512-token minimum context is 465 MiB (each slot
adds 7.3 MiB of sampling state over a 262,144-token vocabulary and a 7.5 MiB window
checkpoint), more than the ~456 MiB that the neighbour, the server and the thresholds
leave; that load is refused with a 507 that names the numbers (and q8_0 KV as the fix).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from cgroup_v1 import NEIGHBOUR, Cgroup, v1_available
from conftest import link_gemma
from serverproc import REPO, ServerProcess, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.cgroup]

MiB = 1024**2
LIMIT = 800 * MiB
NEIGHBOUR_MIB = 191  # 200 MB, touched
MODELS = ("smollm2-135m", "gemma3-270m")
HI = [{"role": "user", "content": "Say hi."}]
SLOTS = {"ELBOWROOM_MODEL_SLOTS": "gemma3-270m=2"}


def _cgroup_or_skip(name: str) -> Cgroup:
    if not v1_available():
        pytest.skip("needs root and a cgroup v1 memory hierarchy at /sys/fs/cgroup/memory")
    try:
        return Cgroup(name, LIMIT)
    except OSError as exc:
        pytest.skip(f"cannot create a memory cgroup: {exc}")


def _env(home: Path) -> dict[str, str]:
    """The environment ServerProcess gives the server: the same data folder for `plan`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELBOWROOM_")}
    env.update(
        XDG_DATA_HOME=str(home / "data"),
        XDG_CACHE_HOME=str(home / "cache"),
        XDG_CONFIG_HOME=str(home / "config"),
        **SLOTS,
    )
    return env


def _plan(cg: Cgroup, home: Path, model: str) -> dict[str, Any]:
    argv = cg.command(sys.executable, "-m", "elbowroom", "plan", model)
    text = subprocess.run(
        argv, cwd=REPO, env=_env(home), capture_output=True, text=True, timeout=120
    )
    print(f"\n$ elbowroom plan {model}   (inside the 800 MiB cgroup)\n{text.stdout}{text.stderr}")
    assert text.returncode == 0, f"{model} does not fit:\n{text.stdout}{text.stderr}"
    data = subprocess.run(
        [*argv, "--json"], cwd=REPO, env=_env(home), capture_output=True, text=True, timeout=120
    )
    assert data.returncode == 0, data.stderr
    return dict(json.loads(data.stdout))


def test_both_llms_load_one_at_a_time_in_800_mib_beside_a_200_mb_neighbour(
    tmp_path: Path, gemma_file: Path | None
) -> None:
    if gemma_file is None:
        pytest.skip("gemma3-270m is not installed (its packages come with scripts/setup.sh)")
    cg = _cgroup_or_skip(f"elbowroom-container-{os.getpid()}")
    link_gemma(tmp_path, gemma_file)
    neighbour = subprocess.Popen(
        cg.command(sys.executable, "-c", NEIGHBOUR),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    server = ServerProcess(
        tmp_path, env={"ELBOWROOM_MONITOR_INTERVAL": "0.2", **SLOTS}, prefix=cg.command()
    )
    try:
        assert neighbour.stdin is not None and neighbour.stdout is not None
        neighbour.stdin.write(b"+%d\n" % NEIGHBOUR_MIB)
        neighbour.stdin.flush()
        assert neighbour.stdout.readline().startswith(b"ok")
        oom_before = cg.oom_kills

        plans = {model: _plan(cg, tmp_path, model) for model in MODELS}
        for plan in plans.values():
            assert plan["limit"]["rule"] == "container", plan["limit"]
            assert plan["fit"]["ok"], plan["fit"]

        url = server.start().url
        http = httpx.Client(base_url=url, timeout=120)
        client = server.openai()
        measured: dict[str, dict[str, Any]] = {}
        for model in (*MODELS, MODELS[0]):
            for row in server.ps():  # one at a time
                assert http.post(f"/api/models/{row['id']}/unload").status_code == 200
            wait_for(lambda: server.ps() == [], timeout=60, what="the other model to unload")
            out = client.chat.completions.create(model=model, messages=HI, max_tokens=8)
            assert out.choices[0].message.content is not None, model
            (row,) = server.ps()
            assert row["id"] == model and row["state"] == "ready"
            measured[model] = row
            memory = server.memory()
            assert memory["limit"]["rule"] == "container", memory["limit"]
            print(
                f"{model}: n_ctx {row['n_ctx']} × {row['slots']} slots, predicted"
                f" {row['predicted'] / MiB:.1f} MiB, measured {row['bytes'] / MiB:.1f} MiB"
                f" (anonymous {row['anonymous'] / MiB:.1f}, file-backed"
                f" {row['file_backed'] / MiB:.1f}); limit {memory['limit']['value'] / MiB:.1f}"
                f" MiB ({memory['limit']['winner']}), ceiling {memory['ceiling'] / MiB:.1f} MiB,"
                f" cgroup usage {cg.usage / MiB:.1f} MiB"
            )

        assert cg.oom_kills == oom_before, "something in the cgroup was OOM-killed"
        assert neighbour.poll() is None, "the neighbour died"
        assert server.proc is not None and server.proc.poll() is None
        assert "exited:" not in server.log(), server.log()[-3000:]  # no runner died
        for model, row in measured.items():
            # the prediction reserved for the load never fell short of what it really held
            # by more than the estimate's ±10 % target
            assert row["bytes"] <= row["predicted"] * 1.10, (model, row)
    finally:
        server.stop(timeout=30)
        if neighbour.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(neighbour.pid, signal.SIGKILL)
            neighbour.wait(timeout=30)
        cg.remove()
