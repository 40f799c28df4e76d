"""An LLM runner holds only what it needs: every import is resident memory in every runner
process, and the footprint estimate does not budget it (a merge once made the runner import
the gguf package through models/vision.py: +13 MiB in every LLM runner, seen as a -7 %
estimate error)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_the_llm_runner_does_not_import_numpy_or_the_gguf_package() -> None:
    code = (
        "import json, sys\n"
        "import elbowroom.runtime.worker, elbowroom.engines.llama\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('numpy', 'gguf', 'yaml', 'PIL', 'ray', 'fastapi', 'uvicorn'))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert json.loads(out.stdout) == []
