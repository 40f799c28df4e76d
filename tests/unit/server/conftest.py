"""Fixtures for the HTTP-layer tests: an app over the fakes in server_fakes.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from server_fakes import Harness, services
from starlette.testclient import TestClient

from elbowroom.config import Settings
from elbowroom.server.app import create_app


@pytest.fixture
def make_harness() -> Iterator[Callable[..., Harness]]:
    clients: list[TestClient] = []

    def make(**settings_changes: Any) -> Harness:
        svc, scheduler = services(Settings(**settings_changes))
        client = TestClient(
            create_app(svc.settings, services=svc),
            base_url="http://localhost",
            raise_server_exceptions=False,
        )
        clients.append(client)
        return Harness(client, scheduler)

    yield make
    for c in clients:
        c.close()


@pytest.fixture
def harness(make_harness: Callable[..., Harness]) -> Harness:
    return make_harness()
