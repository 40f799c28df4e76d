"""How long a JSON schema holds llama.cpp's engine loop: GBNF (what the engine built from a
``response_format`` before) against llguidance (what the runner sends now,
``engines/llama_grammar.py``), on the same engine, interleaved.

One ``xllamacpp.Server`` with the bundled SmolLM2, 2 slots, 1 thread (the engine loop is
one thread whatever the setting). Each round measures a 2-token chat alone, then the same
chat started 0.3 s after a 1-token constrained chat in the other slot:

- GBNF: ``response_format`` with ``^((a?){0,32}){0,32}$`` (21 bytes; every schema bound
  passes). The same pattern at ``{0,1024}`` three deep never finished (tests/e2e/
  test_hostile.py, fails before the change by its 120 s deadline), so the smaller one is
  what can be timed;
- llguidance: the same schema as ``grammar`` (``llama_grammar.constrain``);
- llguidance: ``^(((a?){0,1024}){0,1024}){0,1024}$``.

    python benchmarks/grammar_engine.py --rounds 5   # writes results/grammar_engine.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).with_name("results")
SMALL = {"type": "string", "pattern": "^((a?){0,32}){0,32}$"}
NESTED = {"type": "string", "pattern": "^(((a?){0,1024}){0,1024}){0,1024}$"}
HI = [{"role": "user", "content": "Say hi."}]


def engine() -> Any:
    import xllamacpp

    sys.path.insert(0, str(REPO / "tests"))
    from bundled_models import bundled_spec

    params = xllamacpp.CommonParams()
    params.model.path = str(bundled_spec("smollm2-135m").path)
    params.n_ctx = 2048
    params.n_parallel = 2
    params.kv_unified = False
    params.verbosity = 0
    params.cpuparams.n_threads = 1
    params.cpuparams_batch.n_threads = 1
    return xllamacpp.Server(params)


def gbnf(schema: dict[str, Any]) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}


def llg(schema: dict[str, Any]) -> dict[str, Any]:
    from elbowroom.engines.llama_grammar import constrain

    return constrain({"messages": HI, **gbnf(schema)})


def timed(server: Any, body: dict[str, Any]) -> float:
    began = time.perf_counter()
    out = server.handle_chat_completions(body)
    assert "choices" in out, str(out)[:300]
    return time.perf_counter() - began


def beside(server: Any, extra: dict[str, Any] | None) -> tuple[float, float]:
    """The 2-token chat's seconds (alone when ``extra`` is None) and the constrained one's."""
    plain = {"messages": HI, "max_tokens": 2}
    if extra is None:
        return timed(server, plain), 0.0
    other: list[float] = []
    body = {"messages": HI, "max_tokens": 1, **extra}
    thread = threading.Thread(target=lambda: other.append(timed(server, body)))
    thread.start()
    time.sleep(0.3)
    took = timed(server, plain)
    thread.join()
    return took, other[0]


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    server = engine()
    cases: dict[str, dict[str, Any] | None] = {
        "alone": None,
        "GBNF ((a?){0,32}){0,32}": gbnf(SMALL),
        "llguidance ((a?){0,32}){0,32}": llg(SMALL),
        "llguidance (((a?){0,1024}){0,1024}){0,1024}": llg(NESTED),
    }
    timed(server, {"messages": HI, "max_tokens": 2})  # warm
    loads: list[float] = []
    seen: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        loads.append(os.getloadavg()[0])
        for name, extra in cases.items():
            seen[name].append(beside(server, extra))
    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "rounds": args.rounds,
        "cpus": os.cpu_count(),
        "loadavg_1m": summary(loads),
        "two_token_s": {k: summary([a for a, _ in v]) for k, v in seen.items()},
        "constrained_s": {k: summary([b for _, b in v]) for k, v in seen.items() if cases[k]},
        "raw": seen,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "grammar_engine.json").write_text(json.dumps(result, indent=2))
    alone = result["two_token_s"]["alone"]["median"]
    lines = [
        "# A schema's hold on the engine loop: GBNF against llguidance (issue 28)",
        "",
        f"{result['date']}, {args.rounds} interleaved rounds, {os.cpu_count()} CPUs, 1-minute "
        f"load average median {result['loadavg_1m']['median']:.2f} "
        f"({result['loadavg_1m']['min']:.2f}-{result['loadavg_1m']['max']:.2f}); a machine "
        "shared with other work. SmolLM2, 2 slots, 1 thread. "
        "`python benchmarks/grammar_engine.py`.",
        "",
        "| a 2-token chat beside a 1-token chat constrained by | 2-token s (median, range) | "
        "ratio to alone | constrained s |",
        "|---|---|---|---|",
    ]
    for name in cases:
        two = result["two_token_s"][name]
        con = result["constrained_s"].get(name)
        lines.append(
            f"| {name} | {two['median']:.2f} ({two['min']:.2f}-{two['max']:.2f}) | "
            f"{two['median'] / alone:.2f} | "
            + (f"{con['median']:.2f} ({con['min']:.2f}-{con['max']:.2f})" if con else "-")
            + " |"
        )
    lines.append("")
    (RESULTS / "grammar_engine.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
