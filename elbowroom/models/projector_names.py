"""Pairing a model with its multimodal projector by file name: PURE over names (the rule
is in models/vision.py's docstring, docs/models.md). Its own module so that reading a
GGUF (models/gguf_meta.py) can find the projector beside it without importing the vision
costs, which read GGUF headers themselves."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

MIN_SHARED = 4  # characters a projector's name must share with its model's (several)


def is_projector_name(path: Path) -> bool:
    return path.name.lower().startswith("mmproj") and path.suffix.lower() == ".gguf"


def _norm(name: str) -> str:
    stem = name.lower().removesuffix(".gguf")
    stem = stem.removeprefix("mmproj")
    return re.sub(r"[^a-z0-9]+", "", stem)


def pick_projector(model: Path, candidates: Iterable[Path]) -> Path | None:
    """PURE over names: the projector beside ``model`` by the rule in the module docstring."""
    found = sorted(c for c in candidates if c != model and is_projector_name(c))
    if len(found) <= 1:
        return found[0] if found else None
    mine = _norm(model.name)

    def shared(c: Path) -> int:
        theirs, n = _norm(c.name), 0
        while n < min(len(mine), len(theirs)) and mine[n] == theirs[n]:
            n += 1
        return n

    best = max(found, key=shared)
    return best if shared(best) >= MIN_SHARED else None


def projector_beside(model: Path) -> Path | None:
    try:
        return pick_projector(model, model.parent.iterdir())
    except OSError:
        return None
