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
