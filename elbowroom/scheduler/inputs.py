"""What the scheduler needs from the model layer, as protocols.

``elbowroom.models.catalog.Catalog``, the ``elbowroom.models.estimate`` module and
``elbowroom.models.measured.MeasuredStore`` satisfy these structurally; tests pass their own.
"""

from __future__ import annotations

import importlib
from typing import Protocol, cast

from elbowroom.memory.types import ProcessMemory
from elbowroom.models.spec import Footprint, ModelSpec


class ModelCatalog(Protocol):
    def get(self, model_id: str) -> ModelSpec:
        """The spec of ``model_id``; raises errors.ModelNotFound."""
        ...


class Measurements(Protocol):
    """Measured footprints remembered per model file and settings."""

    def record(
        self, spec: ModelSpec, n_ctx: int, slots: int, kv_type: str, mem: ProcessMemory
    ) -> None: ...

    def lookup(
        self, spec: ModelSpec, n_ctx: int, slots: int, kv_type: str
    ) -> ProcessMemory | None: ...


class Estimator(Protocol):
    """The pure footprint functions of ``elbowroom.models.estimate``; ``measured`` is the
    store of remembered measurements (a measurement for the same file wins)."""

    def footprint(
        self,
        spec: ModelSpec,
        n_ctx: int,
        slots: int = 1,
        kv_type: str = "f16",
        measured: Measurements | None = None,
    ) -> Footprint: ...

    def auto_context(
        self,
        spec: ModelSpec,
        budget_bytes: int,
        settings_max_ctx: int,
        min_ctx: int,
        slots: int = 1,
        kv_type: str = "f16",
        measured: Measurements | None = None,
    ) -> int: ...


def default_estimator() -> Estimator:
    # Imported on first use: the module satisfies the protocol structurally.
    return cast(Estimator, importlib.import_module("elbowroom.models.estimate"))
