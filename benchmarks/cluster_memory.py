"""A runner hosted by a Ray actor on a cluster node: measured there against its prediction.

    python benchmarks/cluster_memory.py [--ctx 2048] [--slots 2] [--out results/cluster_memory]

A simulated cluster on this machine (tests/e2e/ray_cluster.py: the head and one more
raylet, its own temp dir), a ``NodeAgent`` pinned on each node as ``serve --cluster``
places it; on each, every bundled LLM is started with the options the scheduler gives it
(no prompt cache, the footprint alone), asked one short completion, and measured by the
node (``NodeAgent.poll``, the reading the head budgets with). Beside it the same model in a
runner of this process (no Ray): what hosting by an actor adds. The rule
(models/accuracy.py) is applied to every node's runner; results go to OUT.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "e2e"))
sys.path.insert(0, str(REPO / "tests"))

MiB = 2**20


def request(i: int = 0) -> Any:
    from elbowroom.engines.requests import TextRequest

    prompt = f"Story {i}: " + "Once upon a time, " * 20
    return TextRequest(kind="completion", prompt=prompt, max_tokens=16)


def local_runner(spec: Any, options: Any) -> dict[str, int]:
    """The same model in a runner of this process: the single machine's path."""
    from elbowroom.config import load_settings
    from elbowroom.runtime.supervisor import Supervisor

    async def go() -> dict[str, int]:
        sup = Supervisor(spec, lambda *_: None, settings=load_settings(environ={}))
        await sup.start(options)

        async def one(i: int) -> None:
            async for _ in sup.request("completion", request(i)):
                pass

        try:
            await asyncio.gather(*(one(i) for i in range(options.slots)))
            m = sup.measure()
            return {"anonymous": m.anonymous, "file_backed": m.file_backed}
        finally:
            await sup.stop(10)

    return asyncio.run(go())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "cluster_memory"))
    a = ap.parse_args()

    import ray
    from bundled_models import bundled_spec
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    from ray_cluster import local_cluster

    from elbowroom.cluster.agent import NodeAgent
    from elbowroom.config import load_settings
    from elbowroom.engines.options import LlamaOptions
    from elbowroom.models.accuracy import Accuracy
    from elbowroom.models.estimate import footprint

    specs = []
    for name in ("smollm2-135m", "gemma3-270m"):
        try:
            specs.append(bundled_spec(name))
        except LookupError as exc:
            print("skipped:", exc)
    options = LlamaOptions(threads=2, n_ctx=a.ctx, slots=a.slots, cache_ram_bytes=0, kv_cache=False)
    settings = load_settings(environ={})
    rows: list[dict[str, Any]] = []
    os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix="ray27-"))
    with local_cluster("8GiB", {"node1": "8GiB"}) as cluster:
        nodes = {"head": cluster.head_node.node_id, "node1": cluster.named["node1"].node_id}
        for node_name, node_id in nodes.items():
            agent = (
                ray.remote(NodeAgent)
                .options(
                    num_cpus=0,
                    max_concurrency=1000,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                )
                .remote(settings)
            )
            for spec in specs:
                key = f"{spec.id}@{node_name}"
                started = ray.get(agent.start.remote(key, spec, options), timeout=300)
                assert "ready" in started, started
                # one request per slot at once: every slot serves (the prediction's working
                # part holds each slot's sampler state and checkpoint)
                rids = [
                    ray.get(agent.open_request.remote(key, "completion", request(i)))
                    for i in range(a.slots)
                ]
                deadline = time.time() + 120
                while rids and time.time() < deadline:
                    for rid in list(rids):
                        items = ray.get(agent.next_items.remote(rid, 0.2))
                        if items and items[-1].get("end"):
                            rids.remove(rid)
                reading = ray.get(agent.poll.remote())
                m = reading["runners"][key]
                fp = footprint(spec, a.ctx, a.slots)
                acc = Accuracy(key, fp.total, m.resident)
                rows.append(
                    {
                        "model": spec.id,
                        "node": node_name,
                        "predicted": fp.total,
                        "anonymous": m.anonymous,
                        "file_backed": m.file_backed,
                        "measured": m.resident,
                        "error": round(acc.error, 4),
                        "ok": acc.ok,
                        "on_target": acc.on_target,
                        "agent_bytes": reading["agent_bytes"],
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
                ray.get(agent.stop.remote(key, 10))
            ray.kill(agent)
    for spec in specs:
        local = local_runner(spec, options)
        fp = footprint(spec, a.ctx, a.slots)
        measured = local["anonymous"] + local["file_backed"]
        rows.append(
            {
                "model": spec.id,
                "node": "local (no Ray)",
                "predicted": fp.total,
                **local,
                "measured": measured,
                "error": round(Accuracy(spec.id, fp.total, measured).error, 4),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    out = Path(a.out)
    meta = {"ctx": a.ctx, "slots": a.slots, "load_avg": os.getloadavg(), "rows": rows}
    out.with_suffix(".json").write_text(json.dumps(meta, indent=1))
    lines = [
        "| model | where | predicted MiB | anonymous MiB | file-backed MiB | measured MiB "
        "| error |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['node']} | {r['predicted'] / MiB:.1f} | "
            f"{r['anonymous'] / MiB:.1f} | {r['file_backed'] / MiB:.1f} | "
            f"{r['measured'] / MiB:.1f} | {100 * r['error']:+.1f} % |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
