"""Tiny engines for the runner tests' edges: behaviours a real model cannot be made to show
on demand (ignoring stop, ignoring SIGTERM, dying while loading). The worker and the
supervisor around them are the real ones. Imported by the spawned runner process (the
test directory is on sys.path, which multiprocessing's spawn passes to the child)."""

from __future__ import annotations

import os
import signal
import threading
from multiprocessing.connection import Connection
from typing import Any

from elbowroom.engines.base import Cancelled, Emit
from elbowroom.engines.options import EngineOptions
from elbowroom.engines.requests import Payload
from elbowroom.models.spec import ModelSpec
from elbowroom.runtime.worker import serve


class Stubborn:
    """Streams one delta, then blocks forever, ignoring cancellation and the stop op.
    With ``ignore_term`` it also ignores SIGTERM, so only SIGKILL ends it."""

    max_concurrent = 1

    def __init__(self, *, ignore_term: bool = False) -> None:
        self.ignore_term = ignore_term

    def load(self, spec: ModelSpec, options: EngineOptions) -> dict[str, Any]:
        if self.ignore_term:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return {"stub": True}

    def run(self, op: str, payload: Payload, emit: Emit, cancelled: Cancelled) -> dict[str, Any]:
        emit({"type": "delta", "text": "started"})
        threading.Event().wait()
        return {}

    def stats(self) -> dict[str, Any]:
        return {"stub": "stats"}

    def relieve(self, level: int) -> None:
        pass

    def close(self, *, process_exit: bool = False) -> None:
        pass


class NeverLoads(Stubborn):
    def load(self, spec: ModelSpec, options: EngineOptions) -> dict[str, Any]:
        threading.Event().wait()
        return {}


class DiesWhileLoading(Stubborn):
    def load(self, spec: ModelSpec, options: EngineOptions) -> dict[str, Any]:
        os._exit(3)


def stubborn_main(conn: Connection, spec: ModelSpec, options: EngineOptions) -> None:
    raise SystemExit(serve(conn, spec, options, Stubborn()))


def unkillable_main(conn: Connection, spec: ModelSpec, options: EngineOptions) -> None:
    raise SystemExit(serve(conn, spec, options, Stubborn(ignore_term=True)))


def dies_while_loading_main(conn: Connection, spec: ModelSpec, options: EngineOptions) -> None:
    raise SystemExit(serve(conn, spec, options, DiesWhileLoading()))


def never_loads_main(conn: Connection, spec: ModelSpec, options: EngineOptions) -> None:
    raise SystemExit(serve(conn, spec, options, NeverLoads()))
