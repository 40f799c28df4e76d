"""elbowroom over a real Ray cluster simulated on this machine (docs/cluster.md).

``ray.cluster_utils.Cluster`` starts a head and two worker raylets here, each a node with
its own id; ``ELBOWROOM_OVERRIDE_MEMORY`` in each node's environment makes them unequal
(every simulated node would otherwise see this whole machine). Ray's own OOM killer is off
for the same reason. One cluster for the module; every test builds and closes its own
router (real agents, real runner processes, the bundled SmolLM2).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from ray_cluster import local_cluster, wait_for
from text_items import text_items

from elbowroom.config import Settings
from elbowroom.engines.requests import TextRequest
from elbowroom.errors import InsufficientMemory, RunnerCrashed
from elbowroom.models.catalog import discover

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

pytestmark = pytest.mark.slow

MiB = 1024**2
SMOLLM2 = "smollm2-135m"
COUNTING = TextRequest(
    kind="completion", prompt="1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", temperature=0, max_tokens=4
)
# Each node's size: the head smaller than its own agent process (so it sits at hard
# pressure, and no model fits there); B the best fit, A the fallback.
HEAD, NODE_A, NODE_B = "64MiB", "3GiB", "1536MiB"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    with local_cluster(HEAD, {"a": NODE_A, "b": NODE_B}, fast_failure=True) as c:
        yield c


def settings_for(c: Any) -> Settings:
    return Settings(
        cluster=c.address,
        cluster_poll=0.25,
        load_timeout=120.0,
        stop_grace=2.0,
        slots=1,
        max_ctx=1024,
        kv_cache=False,
        kv_ram_max=0,
    )


async def complete(router: Any, max_tokens: int = 4) -> list[dict[str, Any]]:
    async with router.use(SMOLLM2) as runner:
        return [item async for item in text_items(runner, replace(COUNTING, max_tokens=max_tokens))]


def node_of(c: Any, name: str) -> Any:
    """The cluster_utils node whose id the router's node name ends with."""
    for node in c.named.values():
        if name.endswith(node.node_id[:6]):
            return node
    raise LookupError(name)


def test_nodes_seen_with_their_own_memory_and_model_placed_by_best_fit(cluster: Any) -> None:
    from elbowroom.cluster.connect import ClusterServices

    async def main() -> None:
        settings = settings_for(cluster)
        cs = ClusterServices(settings, discover(settings), None)
        router = await cs.build()
        try:
            totals = sorted(e.node.snapshot().total for e in router.live())
            assert totals == sorted([64 * MiB, 3 * 1024 * MiB, 1536 * MiB]), (
                "each node's probe applies its own override"
            )
            items = await complete(router)
            assert items[-1]["type"] == "done" and items[-1]["text"].strip()
            (row,) = router.ps()
            b = cluster.named["b"]
            assert row["node"].endswith(b.node_id[:6]), (row, "best fit is node B")
            report = router.memory_report()
            assert report["cluster"] is True and len(report["nodes"]) == 3
            assert report["cluster_pressure"]["level"] in ("normal", "soft", "hard")
            assert {n["name"] for n in report["nodes"] if SMOLLM2 in n.get("models", [])} == {
                row["node"]
            }
        finally:
            await router.close()

    asyncio.run(main())


def test_a_model_too_big_for_every_node_is_refused_with_each_node(cluster: Any) -> None:
    from elbowroom.cluster.connect import ClusterServices

    async def main() -> None:
        # max_ctx beyond what SmolLM2's KV fits in B or A with 64 slots, min_ctx forcing it
        settings = settings_for(cluster).replace(slots=64, min_ctx=8192, max_ctx=8192)
        cs = ClusterServices(settings, discover(settings), None)
        router = await cs.build()
        try:
            with pytest.raises(InsufficientMemory) as err:
                await complete(router)
            assert err.value.status == 507
            names = [n["name"] for n in err.value.details["nodes"]]
            assert len(names) == 3
            assert all(name in err.value.message for name in names)
        finally:
            await router.close()

    asyncio.run(main())


def test_cluster_pressure_is_the_worst_node_and_only_that_node_refuses(cluster: Any) -> None:
    """The head is over its own (tiny) override: hard. The cluster is hard, named by it;
    the door stays open and the model is served from a node under no pressure."""
    from elbowroom.cluster.connect import ClusterServices
    from elbowroom.cluster.views import ClusterGuard

    async def main() -> None:
        settings = settings_for(cluster)
        cs = ClusterServices(settings, discover(settings), None)
        router = await cs.build()
        try:
            head = next(e for e in router.live() if e.node.snapshot().total == 64 * MiB)
            await wait_for(lambda: head.guard.latest is not None, 10, "the head's first sample")
            pressure = router.pressure()
            assert pressure["level"] == "hard" and pressure["worst"] == [head.node.name]
            others = {k: v for k, v in pressure["nodes"].items() if k != head.node.name}
            assert set(others.values()) == {"normal"}
            assert not head.guard.admission_open()  # that node's guard refuses...
            guard = ClusterGuard(router)
            assert guard.admission_open()  # ...the cluster's door does not
            assert guard.state()["level"] == "hard"
            items = await complete(router)
            assert items[-1]["type"] == "done"
            report = router.memory_report()
            assert report["pressure"] == "hard" and report["worst_node"] == head.node.name
        finally:
            await router.close()

    asyncio.run(main())


def test_a_client_that_leaves_mid_stream_frees_the_remote_slot(cluster: Any) -> None:
    from elbowroom.cluster.connect import ClusterServices

    async def main() -> None:
        settings = settings_for(cluster)
        cs = ClusterServices(settings, discover(settings), None)
        router = await cs.build()
        try:
            async with router.use(SMOLLM2) as runner:
                stream = text_items(runner, replace(COUNTING, max_tokens=2000))
                first = await stream.__anext__()
                assert first.get("type") != "done"
                stats = await runner.stats()
                assert stats["slots_busy"] == 1
                await stream.aclose()  # the client went away
                end = time.monotonic() + 30
                while (await runner.stats())["slots_busy"] != 0:
                    assert time.monotonic() < end, "the remote generation was not cancelled"
                    await asyncio.sleep(0.1)
        finally:
            await router.close()

    asyncio.run(main())


def test_a_remote_runner_that_dies_is_reported_and_restarted(cluster: Any) -> None:
    """kill -9 of the runner process on its node (the node lives on): the scheduler of
    that node hears the exit cause through the agent, and the next request restarts it."""
    from elbowroom.cluster.connect import ClusterServices

    async def main() -> None:
        settings = settings_for(cluster)
        cs = ClusterServices(settings, discover(settings), None)
        router = await cs.build()
        try:
            await complete(router)
            (row,) = router.ps()
            os.kill(row["pid"], signal.SIGKILL)  # a simulated node's processes are local
            await wait_for(lambda: router.ps() == [], 30, "the crash to be noticed")
            crash = [e for e in router.events.recent(600) if e.kind == "crash"]
            assert crash and "SIGKILL" in crash[-1].message and row["node"] in crash[-1].message
            items = await complete(router)
            assert items[-1]["type"] == "done"
            (again,) = router.ps()
            assert again["node"] == row["node"] and again["pid"] != row["pid"]
        finally:
            await router.close()

    asyncio.run(main())


@pytest.fixture(scope="module")
def cluster_server(cluster: Any, server_factory: Any) -> Any:
    """The real server joined to the cluster (`serve --cluster ADDRESS`)."""
    return server_factory(
        "--cluster",
        cluster.address,
        "--slots",
        "1",
        env={"ELBOWROOM_MAX_CTX": "1024", "ELBOWROOM_KV_CACHE": "false"},
    )


def test_serve_cluster_answers_openai_and_shows_nodes(cluster: Any, cluster_server: Any) -> None:
    """The official client; /api/memory and ps show the nodes and where the model runs."""
    server = cluster_server
    reply = server.openai().chat.completions.create(
        model=SMOLLM2,
        messages=[{"role": "user", "content": "Count: 1, 2, 3,"}],
        max_tokens=4,
        temperature=0,
    )
    assert reply.choices[0].message.content
    with server.http() as http:
        memory = http.get("/api/memory").json()
    assert memory["cluster"] is True
    assert len([n for n in memory["nodes"] if n["alive"]]) == 3
    (row,) = server.ps()
    assert row["node"].endswith(cluster.named["b"].node_id[:6])
    # `elbowroom ps`, for people and as JSON: where each model runs, and every node.
    cli = [sys.executable, "-m", "elbowroom", "ps", "--url", server.url]
    text = subprocess.run(cli, capture_output=True, text=True, check=True, timeout=60).stdout
    assert "NODE" in text and row["node"] in text and text.count("yes") >= 3
    data = json.loads(
        subprocess.run(
            [*cli, "--json"], capture_output=True, text=True, check=True, timeout=60
        ).stdout
    )
    assert {n["name"] for n in data["nodes"] if SMOLLM2 in n["models"]} == {row["node"]}


def test_numbers_are_labelled_cluster_totals_and_memory_url_shows_every_node(
    cluster: Any, cluster_server: Any
) -> None:
    """`ps`'s footer, the startup line and `elbowroom memory --url` say whose numbers they
    are: the sums over the live nodes (not the head's alone), then each node's own."""
    server = cluster_server
    memory = server.memory()
    totals = memory["totals"]
    live = [n for n in memory["nodes"] if n["alive"]]
    assert totals["nodes"] == 3 and totals["ceiling"] == sum(n["ceiling"] for n in live)
    assert totals["ceiling"] > max(n["ceiling"] for n in live)  # not one node's figure
    startup = server.log()
    assert "memory, cluster total over 3 nodes: limit" in startup, startup
    assert "SIGTERM handler is not set" not in startup  # Ray's noise, not ours
    assert startup.count("  node ") >= 3  # then one line per node
    # `elbowroom ps`: the footer is the cluster's totals, labelled.
    ps = server.cli("ps")
    assert ps.returncode == 0, ps.stderr
    footer = ps.stdout.strip().splitlines()[-1]
    assert footer.startswith("cluster total over 3 nodes: committed "), footer
    ps_json = json.loads(server.cli("ps", "--json").stdout)
    assert ps_json["memory"]["scope"] == "cluster"
    assert ps_json["memory"]["ceiling"] == totals["ceiling"]
    # `elbowroom memory --url`: one row per node, and the totals, labelled.
    text = server.cli("memory")
    assert text.returncode == 0, text.stderr
    assert "a cluster of 3 live nodes" in text.stdout
    assert all(n["name"] in text.stdout for n in live)
    assert "cluster total over 3 nodes (sums of the rows above)" in text.stdout
    data = json.loads(server.cli("memory", "--json").stdout)
    assert data["cluster"] is True and data["totals"]["nodes"] == 3


def test_a_model_that_fits_only_split_without_the_rpc_build_is_a_507_naming_the_command(
    cluster: Any, server_factory: Any, tmp_path: Any
) -> None:
    """SmolLM2 with 16 slots of 8,192 tokens (~3 GiB) fits on no node but would fit split
    over A and B; with no RPC build on the nodes (an empty rpc_bin_dir) the request is
    refused at once in the API's shape, naming the command that enables splitting, and
    nothing is reserved on any node (it used to be a 500 after the share was reserved)."""
    server = server_factory(
        "--cluster",
        cluster.address,
        "--model-slots",
        f"{SMOLLM2}=16",
        env={
            "ELBOWROOM_MIN_CTX": "8192",
            "ELBOWROOM_MAX_CTX": "8192",
            "ELBOWROOM_KV_CACHE": "false",
            "ELBOWROOM_RPC_BIN_DIR": str(tmp_path),  # no rpc-server, no llama-server there
        },
    )
    import openai

    with pytest.raises(openai.APIStatusError) as err:
        server.openai(max_retries=0).chat.completions.create(
            model=SMOLLM2, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert err.value.status_code == 507, err.value.response.text
    body = err.value.response.json()["error"]
    assert body["code"] == "split_unavailable" and body["type"] == "insufficient_memory"
    message = body["message"]
    assert "fits only split" in message and "ELBOWROOM_RPC=1 scripts/setup.sh" in message
    assert body["enable_split"] == "ELBOWROOM_RPC=1 scripts/setup.sh"
    assert set(body["missing"]) == set(body["split_layers"]) and len(body["missing"]) >= 2
    assert ". A split" not in message and "--ctx It" not in message  # sentences apart
    # Decided before anything was reserved: no share on any node, nothing committed.
    assert server.ps() == []
    assert all(n.get("committed", 0) == 0 for n in server.memory()["nodes"] if n["alive"])
    assert "internal_error" not in server.log()
    assert server.stop() == 0


def test_the_dashboard_shows_the_nodes_in_a_real_browser(cluster_server: Any) -> None:
    """Debian's headless Chromium through Playwright (as tests/e2e/test_dashboard_browser.py);
    then the server stops cleanly, its agents and runners with it."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="the dev extra's playwright")
    chromium_path = os.environ.get("ELBOWROOM_CHROMIUM") or shutil.which("chromium")
    if not chromium_path:
        cluster_server.stop()
        pytest.skip("no Chromium binary (scripts/test.sh installs Debian's chromium as root)")
    server = cluster_server
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(server.url + "/ui", wait_until="load")
            rows = page.locator("#nodes tbody tr")
            sync_api.expect(rows).to_have_count(3, timeout=30_000)
            sync_api.expect(page.locator("#nodes-section")).to_be_visible()
            home = page.locator("#nodes tbody tr", has_text=SMOLLM2)
            sync_api.expect(home).to_have_count(1)
            model = page.locator(f'#models tr[data-model="{SMOLLM2}"]')
            sync_api.expect(model).to_contain_text(" on ")
            assert not errors, errors
        finally:
            browser.close()
    assert server.stop() == 0


def test_node_killed_mid_stream_fails_fast_then_model_is_replaced_and_a_new_node_used(
    cluster: Any, capfd: pytest.CaptureFixture[str]
) -> None:
    """Runs last: it removes node B from the module's cluster and adds a node C. The error
    speaks elbowroom (the node, what failed, what happens next), not Ray's exception
    names; Ray's report of the dead raylet (its last 20 log lines) is not printed; the
    node stays in the node table, marked gone, with its cause."""
    from elbowroom.cluster.connect import ClusterServices

    async def main() -> None:
        settings = settings_for(cluster)
        cs = ClusterServices(settings, discover(settings), None)
        router = await cs.build()
        try:
            await complete(router)  # loaded on B (best fit)
            (row,) = router.ps()
            victim = node_of(cluster, row["node"])
            assert victim is cluster.named["b"]
            got: list[dict[str, Any]] = []
            with pytest.raises(RunnerCrashed) as err:
                async with router.use(SMOLLM2) as runner:
                    payload = replace(COUNTING, max_tokens=400)
                    async for item in text_items(runner, payload):
                        got.append(item)
                        if len(got) == 1:  # mid-stream: kill the node (raylet and workers)
                            killed_at = time.monotonic()
                            cluster.remove_node(victim, allow_graceful=False)
            failed_in = time.monotonic() - killed_at
            print(f"in-flight request failed {failed_in:.2f} s after the node was killed")
            assert got and got[-1].get("type") != "done"
            assert row["node"] in err.value.message and err.value.status == 503
            message = err.value.message
            assert "stopped answering" in message and "on another node" in message, message
            assert "Error" not in message and "Ray no longer reaches" in message, message
            assert failed_in < 15.0, f"the in-flight request took {failed_in:.1f} s to fail"
            # The next request places the model again, on A, and is served.
            items = await complete(router)
            assert items[-1]["type"] == "done"
            (again,) = router.ps()
            assert again["node"].endswith(cluster.named["a"].node_id[:6])
            gone = [n for n in router.memory_report()["nodes"] if not n["alive"]]
            assert [n["name"] for n in gone] == [row["node"]]
            assert "stopped answering" in gone[0]["gone_cause"] and gone[0]["gone_at"] > 0
            # A node that joins is used: C (1 GiB) is now the best fit for the next load.
            joined = cluster.add_node(
                num_cpus=1,
                object_store_memory=80 * MiB,
                include_dashboard=False,
                env_vars={"ELBOWROOM_OVERRIDE_MEMORY": "1GiB"},
            )
            tail = joined.node_id[:6]
            await wait_for(
                lambda: any(e.node.name.endswith(tail) for e in router.live()),
                60,
                "the joined node to be used",
            )
            await router.unload(SMOLLM2)
            await complete(router)
            (moved,) = router.ps()
            assert moved["node"].endswith(tail), moved
        finally:
            await router.close()

    asyncio.run(main())
    printed = capfd.readouterr()
    assert "[state-dump]" not in printed.out + printed.err
