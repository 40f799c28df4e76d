"""Joining a cluster: a Ray Client server that dies as it starts is retried (the edge,
Ray's module, is faked: the bug it stands for is ray-project/ray#63202)."""

from __future__ import annotations

import pytest


class _FlakyRay:
    """Ray's module as join() uses it, whose client init fails ``failures`` times the way
    ray-project/ray#63202 does."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.inits = 0
        self.shutdowns = 0
        self.connected = False

    def is_initialized(self) -> bool:
        return self.connected

    def init(self, **_kw: object) -> None:
        self.inits += 1
        if self.inits <= self.failures:
            raise ConnectionAbortedError(
                "Initialization failure from server: RuntimeError: Starting Ray client server "
                "failed."
            )
        self.connected = True

    def shutdown(self) -> None:
        self.shutdowns += 1


def test_join_retries_a_ray_client_server_that_died_at_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from elbowroom.cluster import connect

    flaky = _FlakyRay(failures=2)
    monkeypatch.setattr(connect, "_import_ray", lambda: flaky)
    assert connect.join("ray://10.0.0.1:10001") is flaky
    assert flaky.inits == 3 and flaky.shutdowns == 2
    # A driver address is not retried, and the error names the address and the fix.
    monkeypatch.setattr(connect, "_import_ray", lambda: _FlakyRay(failures=1))
    with pytest.raises(connect.ClusterError, match=r"10\.0\.0\.1:6379.*ray start --head"):
        connect.join("10.0.0.1:6379")


def test_rays_error_reports_and_sigterm_warning_stay_out_of_the_server_log(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """A raylet's death reaches every driver as a printed report with its last 20 log
    lines ([state-dump] ...): one line of elbowroom's log instead. Ray's warning that it
    could not set its SIGTERM handler (we join from a thread) is dropped."""
    import logging

    worker = pytest.importorskip("ray._private.worker")
    from elbowroom.cluster.connect import quiet_ray

    printer = worker.print_to_stdstream
    try:
        quiet_ray()
        quiet_ray()  # idempotent: wrapped once
        report = (
            "Raylet is terminated. Termination is unexpected. Last 20 lines of the Raylet "
            "logs:\n    [state-dump] NodeManager:\n    [state-dump] Node ID: abc\n"
        )
        with caplog.at_level(logging.INFO):
            worker.print_to_stdstream(
                {"lines": [report], "pid": "raylet", "is_err": False}, ignore_prefix=False
            )
            logging.getLogger("ray._private.worker").warning(
                "SIGTERM handler is not set because current thread is not the main thread."
            )
        out = capsys.readouterr()
        assert "[state-dump]" not in out.out + out.err + caplog.text
        assert "SIGTERM handler" not in out.out + out.err + caplog.text
        (record,) = [r for r in caplog.records if "Ray reports" in r.getMessage()]
        assert "Raylet is terminated. Termination is unexpected." in record.getMessage()
    finally:
        worker.print_to_stdstream = printer
        for f in list(logging.getLogger("ray._private.worker").filters):
            logging.getLogger("ray._private.worker").removeFilter(f)


def test_a_gone_node_ray_still_lists_stays_in_the_table_until_a_new_agent_runs() -> None:
    """Ray lists a dead node as alive until its heartbeats are missed: the membership check
    tries a new agent there, which fails. The node must stay in the table, marked gone
    (it used to be retired first, and vanished from ps, /api/memory and the dashboard)."""
    import asyncio
    import time
    from types import SimpleNamespace

    from elbowroom.cluster.connect import ClusterServices
    from elbowroom.cluster.router import NodeEntry
    from elbowroom.config import Settings

    now = time.time()
    gone = SimpleNamespace(id="n1", name="10.0.0.2", alive=False, gone_at=now, gone_cause="x")

    class _Ray:
        def nodes(self) -> list[dict[str, object]]:
            return [{"NodeID": "n1", "NodeManagerAddress": "10.0.0.2", "Alive": True}]

    async def main() -> None:
        cs = ClusterServices(Settings(cluster="127.0.0.1:6379"), None, None)
        cs._ray = _Ray()
        cs.router.nodes["n1"] = NodeEntry(node=gone, scheduler=SimpleNamespace())

        async def no_agent(node_id: str, name: str) -> object:
            raise RuntimeError("The actor died unexpectedly before finishing this task.\n...")

        cs._start_node = no_agent  # type: ignore[method-assign]
        await cs._discover()
        assert cs.router.nodes["n1"].node is gone
        rows = cs.router.memory_report()["nodes"]
        listed = [(r["name"], r["alive"], r["gone_cause"]) for r in rows]
        assert listed == [("10.0.0.2", False, "x")]
        gone.gone_at = now - 601  # shown 10 minutes, then out of the table
        assert cs.router.memory_report()["nodes"] == []

    asyncio.run(main())


def test_serve_help_names_every_cluster_address_form() -> None:
    import argparse

    from elbowroom.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    text = sub.choices["serve"].format_help()
    assert "ray://HOST:10001" in text and "HOST:6379" in text and "auto" in text
    memory = sub.choices["memory"].format_help()
    assert "--url" in memory and "/api/memory" in memory
