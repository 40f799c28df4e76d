"""How a request's messages travel from a node's agent to the head.

Connected as a Ray driver, the agent's ``request`` is a Ray streaming generator: each
message is pushed as soon as the runner emits it. Ray Client (``--cluster ray://...``)
does not carry streaming generators, so there the head pulls instead: the agent queues
the request's messages (``open_request``) and each ``next_items`` call returns what has
arrived, waiting up to ``PULL_WAIT`` seconds for the first. Both give the same messages
(``{"item": ...}`` per delta/done, ``{"error": wire}`` last on failure); closing either
cancels the work on the node.
"""

from __future__ import annotations

import collections
from typing import Any, Protocol

from elbowroom.engines.requests import Payload

PULL_WAIT = 10.0  # seconds one pull waits for a message before asking again
END = {"end": True}  # the pulled stream's last message


def client_mode() -> bool:
    """Connected through Ray Client (a ``ray://`` address)?"""
    try:
        from ray.util.client import ray as client
    except ImportError:
        return False
    stub: Any = client  # Ray's client stub is untyped
    return bool(stub.is_connected())


class Source(Protocol):
    async def next(self) -> dict[str, Any] | None:
        """The next message; None at the end."""
        ...

    def cancel(self) -> None: ...


class Streamed:
    """The agent's ``request`` as a Ray streaming generator."""

    def __init__(self, agent: Any, key: str, kind: str, payload: Payload) -> None:
        self._stream = agent.request.options(num_returns="streaming").remote(key, kind, payload)

    async def next(self) -> dict[str, Any] | None:
        try:
            ref = await self._stream.__anext__()
        except StopAsyncIteration:
            return None
        value: dict[str, Any] = await ref
        return value

    def cancel(self) -> None:
        import ray

        ray.cancel(self._stream)


class Pulled:
    """The agent's queued request (``open_request``), pulled with ``next_items``."""

    def __init__(self, agent: Any, rid: str) -> None:
        self._agent = agent
        self._rid = rid
        self._buffer: collections.deque[dict[str, Any]] = collections.deque()

    @classmethod
    async def open(cls, agent: Any, key: str, kind: str, payload: Payload) -> Pulled:
        rid: str = await agent.open_request.remote(key, kind, payload)
        return cls(agent, rid)

    async def next(self) -> dict[str, Any] | None:
        while not self._buffer:
            self._buffer.extend(await self._agent.next_items.remote(self._rid, PULL_WAIT))
        msg = self._buffer.popleft()
        return None if msg.get("end") else msg

    def cancel(self) -> None:
        self._agent.cancel_request.remote(self._rid)
