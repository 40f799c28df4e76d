"""A Ray cluster of several raylets on this machine, for the cluster tests."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

MiB = 1024**2
OOM_KILLER = "RAY_memory_monitor_refresh_ms"  # Ray's OOM killer: off (a shared host)
# Notice a killed node in about a second, not Ray's 30 s default.
FAST_FAILURE = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 300,
    "health_check_timeout_ms": 300,
    "health_check_failure_threshold": 3,
}


@contextmanager
def local_cluster(
    head: str,
    nodes: dict[str, str],
    *,
    fast_failure: bool = False,
    client_port: int | None = None,
) -> Iterator[Any]:
    """The head and one node per entry of ``nodes`` (name -> the memory size that node's
    elbowroom sees, ``ELBOWROOM_OVERRIDE_MEMORY``), one CPU and a small object store each,
    connected as the driver; ``cluster.named`` maps the names to Ray's node handles.
    ``client_port``: the head also runs the Ray Client server there (``ray://``)."""
    import ray
    from ray import cluster_utils

    saved = os.environ.get(OOM_KILLER)
    os.environ[OOM_KILLER] = "0"
    node_args: dict[str, Any] = {
        "num_cpus": 1,
        "object_store_memory": 80 * MiB,
        "include_dashboard": False,
    }
    # Ray's ports: the GCS, raylets, workers and agents pick free ones, but the head's
    # dashboard agent defaults to 52365, which another cluster on this machine (another
    # test run) may hold: a free one here too.
    head_args: dict[str, Any] = {
        **node_args,
        "env_vars": {"ELBOWROOM_OVERRIDE_MEMORY": head},
        "dashboard_agent_listen_port": free_port(),
    }
    if fast_failure:
        head_args["_system_config"] = FAST_FAILURE
    if client_port is not None:
        head_args["ray_client_server_port"] = client_port
    c = cluster_utils.Cluster(initialize_head=True, head_node_args=head_args)
    try:
        c.named = {
            name: c.add_node(**node_args, env_vars={"ELBOWROOM_OVERRIDE_MEMORY": size})
            for name, size in nodes.items()
        }
        c.wait_for_nodes()
        ray.init(address=c.address, namespace="elbowroom", log_to_driver=False)
        try:
            yield c
        finally:
            ray.shutdown()
    finally:
        c.shutdown()
        if saved is None:
            os.environ.pop(OOM_KILLER, None)
        else:
            os.environ[OOM_KILLER] = saved


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_for(predicate: Callable[[], bool], deadline: float, what: str) -> None:
    """Wait (in the event loop) until ``predicate`` holds, failing after ``deadline`` s."""
    end = time.monotonic() + deadline
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {deadline} s waiting for {what}")
        await asyncio.sleep(0.05)


def alive(pid: int) -> bool:
    """True while ``pid`` exists (a zombie still counts: its parent has not reaped it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
