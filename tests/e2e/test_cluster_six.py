"""Six models of every kind placed over three unequal nodes: no node overcommitted.

A simulated Ray cluster (``ray.cluster_utils``) of 800 MiB, 1.25 GiB and 640 MiB nodes
(``ELBOWROOM_OVERRIDE_MEMORY`` per node; Ray's OOM killer off: every simulated node sees
the whole host). The six bundled models (two LLMs, two speech-to-text, text-to-speech,
embeddings) are loaded one after another through the router with real runners; then
every node's committed bytes are within its load ceiling, its real probe shows room left,
and every model answers from its node.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from ray_cluster import local_cluster
from text_items import text_items

from elbowroom.config import Settings
from elbowroom.engines.requests import EmbedRequest, TextRequest
from elbowroom.models.catalog import discover

ray = pytest.importorskip("ray")
pytest.importorskip("ray.cluster_utils")

pytestmark = pytest.mark.slow

SIZES = {"head": "800MiB", "a": "1280MiB", "b": "640MiB"}
SIX = ("gemma3-270m", "whisper-tiny.en", "smollm2-135m", "piper-en-us-joe", "sphinx-en-us",
       "minilm-l6-v2")  # fmt: skip


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    nodes = {name: SIZES[name] for name in ("a", "b")}
    with local_cluster(SIZES["head"], nodes) as c:
        yield c


def test_six_models_on_three_unequal_nodes_none_overcommitted(cluster: Any) -> None:
    from elbowroom.cluster.connect import ClusterServices

    # Placement only: the three simulated nodes share one host, so a node's guard reads the
    # other nodes' runners loading as "memory held by other processes grows 250 MiB/s" and
    # unloads an idle model at soft pressure (its trend rule, tested in the guard's tests).
    settings = Settings(
        cluster=cluster.address, cluster_poll=0.25, load_timeout=180.0, stop_grace=2.0,
        slots=1, ctx=512, kv_cache=False, kv_ram_max=0, memory_guard=False,
    )  # fmt: skip
    catalog = discover(settings)
    missing = [m for m in SIX if m not in {s.id for s in catalog.list()}]
    if missing:
        pytest.skip(f"bundled models not installed: {', '.join(missing)}")

    async def main() -> None:
        cs = ClusterServices(settings, catalog, None)
        router = await cs.build()
        try:
            for model in SIX:
                result = await router.load(model)
                assert result["node"], result
            rows = {r["id"]: r for r in router.ps()}
            assert set(rows) == set(SIX), f"evicted or missing: {set(SIX) - set(rows)}"
            report = router.memory_report()
            used_nodes = {r["node"] for r in rows.values()}
            assert len(used_nodes) >= 2
            for node in report["nodes"]:
                assert node["alive"]
                assert node["committed"] <= node["ceiling"], node["name"]
                assert node["snapshot"]["available"] > 0, node["name"]
            # Every model answers from its node (one small request each).
            async with router.use("smollm2-135m") as runner:
                hi = TextRequest(kind="completion", prompt="Hi", max_tokens=2)
                items = [i async for i in text_items(runner, hi)]
            assert items[-1]["type"] == "done"
            async with router.use("minilm-l6-v2") as runner:
                items = [
                    i async for i in runner.request("embed", EmbedRequest(inputs=("a cluster",)))
                ]
            assert items[-1]["type"] == "done"
            print({m: r["node"] for m, r in rows.items()})
        finally:
            await router.close()

    asyncio.run(main())
