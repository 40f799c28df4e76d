"""A load in progress can be stopped (issue 28): a real runner that spins in a crafted chat
template while it loads is measured, and stopped at once instead of at load_timeout."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import replace
from pathlib import Path

import pytest
import xllamacpp  # noqa: F401  (a hard dependency: a broken install fails, never skips)
from bundled_models import bundled_spec
from crafted_gguf import CRAFTED_TEMPLATES, with_chat_template

from elbowroom.config import Settings
from elbowroom.engines.options import LlamaOptions
from elbowroom.errors import RunnerCrashed
from elbowroom.runtime.protocol import Runner, RunnerState
from elbowroom.runtime.supervisor import Supervisor


@pytest.mark.slow
def test_a_runner_spinning_while_it_loads_is_stopped_at_once(tmp_path: Path) -> None:
    source = bundled_spec("smollm2-135m")
    # 10^10 iterations of an empty loop: the engine spins (with little memory) while loading.
    template = CRAFTED_TEMPLATES["template-nested"][0]
    path = with_chat_template(source.path, tmp_path / "spin.gguf", template)
    spec = replace(source, id="spin", path=path)
    exits: list[str] = []

    def on_exit(runner: Runner, cause: str) -> None:
        exits.append(cause)

    sup = Supervisor(spec, on_exit, settings=Settings(load_timeout=170.0, stop_grace=5.0))

    async def scenario() -> None:
        # A ceiling, as the scheduler gives CPU runners: never the host's memory.
        options = LlamaOptions(n_ctx=512, kv_cache=False, memory_ceiling=2 * 1024**3)
        start = asyncio.create_task(sup.start(options))
        deadline = time.monotonic() + 120
        # Loaded weights and still not ready: it is in the template.
        while sup.pid is None or sup.measure().resident < 50 * 1024**2:
            assert not start.done(), start
            assert time.monotonic() < deadline, "the runner never got going"
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)
        assert not start.done() and sup.state is RunnerState.STARTING
        pid = sup.pid
        assert pid is not None and sup.measure().resident > 0  # the guard can count it
        stopped = time.monotonic()
        await sup.stop(0.0)
        with pytest.raises(RunnerCrashed):
            await asyncio.wait_for(start, 30)
        assert time.monotonic() - stopped < 30  # not load_timeout's 170 s
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)

    asyncio.run(scenario())
