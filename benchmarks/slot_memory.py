"""Every slot of a bundled LLM's runner serving a long prompt at once, against its prediction.

    python benchmarks/slot_memory.py [MODEL] [SLOTS...]     # default: gemma3-270m 1 2 8

The runner is the single machine's (``cluster_memory.local_runner``: on a cluster node a
runner holds the same bytes, ±2 MiB); each slot gets a ~1,000-token prompt, more than a
sliding-window model's window, so every slot holds what the estimate budgets for it (its
sampler state and a whole-window context checkpoint). Short prompts leave part of that
unallocated, which is what the +9 … +13 % of ``cluster_memory.md`` measured.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
LONG = " ".join(
    f"The {i}th traveller said something about the weather and the harbour." for i in range(90)
)


def long_request(i: int = 0) -> Any:
    from elbowroom.engines.requests import TextRequest

    return TextRequest(kind="completion", prompt=f"Story {i}: " + LONG, max_tokens=16)


def main(argv: list[str]) -> None:
    sys.path[:0] = [str(HERE), str(HERE.parent / "tests"), str(HERE.parent / "tests" / "e2e")]
    import cluster_memory
    from bundled_models import bundled_spec

    from elbowroom.engines.options import LlamaOptions
    from elbowroom.models.estimate import footprint

    cluster_memory.request = long_request
    name = argv[0] if argv else "gemma3-270m"
    spec = bundled_spec(name)
    for slots in [int(s) for s in argv[1:]] or [1, 2, 8]:
        options = LlamaOptions(
            threads=2, n_ctx=2048, slots=slots, cache_ram_bytes=0, kv_cache=False
        )
        m = cluster_memory.local_runner(spec, options)
        predicted = footprint(spec, 2048, slots).total
        measured = m["anonymous"] + m["file_backed"]
        row = {
            "model": name,
            "ctx": 2048,
            "slots": slots,
            "predicted": predicted,
            **m,
            "error_pct": round(100 * (predicted / measured - 1), 1),
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
