"""``serve --cluster ray://HOST:PORT``: the server joins through Ray Client (docs/cluster.md).

A head started here with Ray's client server (``ray_client_server_port``, what ``ray start
--head --ray-client-server-port`` runs), then the real server joined to it with a ``ray://``
address: the official OpenAI client gets a completion and a stream from a model whose
runner lives on the node (Ray Client carries no streaming generators, so the head pulls the
agent's messages: cluster/relay.py), and the server stops cleanly, its runner with it.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest
from ray_cluster import alive, local_cluster

pytest.importorskip("ray")
pytest.importorskip("grpc", reason="Ray Client needs ray[client] (the cluster extra)")

pytestmark = pytest.mark.slow

SMOLLM2 = "smollm2-135m"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def client_address() -> Iterator[str]:
    port = free_port()
    with local_cluster("2GiB", {}, client_port=port):
        yield f"ray://127.0.0.1:{port}"


def test_serve_through_a_ray_client_address(client_address: str, server_factory: Any) -> None:
    server = server_factory(
        "--cluster",
        client_address,
        "--slots",
        "1",
        env={"ELBOWROOM_MAX_CTX": "1024", "ELBOWROOM_KV_CACHE": "false"},
    )
    client = server.openai()
    messages = [{"role": "user", "content": "Count: 1, 2, 3,"}]
    reply = client.chat.completions.create(
        model=SMOLLM2, messages=messages, max_tokens=4, temperature=0
    )
    assert reply.choices[0].message.content
    chunks = client.chat.completions.create(
        model=SMOLLM2, messages=messages, max_tokens=8, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed.startswith(reply.choices[0].message.content.strip()[:3])
    memory = server.memory()
    assert memory["cluster"] is True and [n["alive"] for n in memory["nodes"]] == [True]
    (row,) = server.ps()
    assert row["id"] == SMOLLM2 and row["node"] and row["pid"]
    assert server.stop() == 0
    assert not alive(row["pid"]), "the runner on the node stopped with the server"
