"""A model spec whose file does not exist: enough for tests of how a runner process starts,
which never load it."""

from __future__ import annotations

from pathlib import Path

from elbowroom.models.spec import Holding, ModelKind, ModelSpec

SPEC = ModelSpec(
    id="x",
    kind=ModelKind.LLM,
    engine="llama",
    path=Path("/nonexistent/x.gguf"),
    size_bytes=1,
    holding=Holding.MMAP,
    source="path",
)
