"""The kill order the kernel sees: PURE. Each runner's ``oom_score_adj`` from the guard's
eviction order, so that when the OOM killer still has to pick, it picks what the guard
would have unloaded next: an idle model (no request lost), the least recently used first.

The kernel's badness is a process's resident bytes plus ``oom_score_adj`` thousandths of
the memory it may use (the cgroup's limit inside one): a step of 100 weighs a tenth of the
limit. Raising a score needs no privilege; lowering one below where it started
(``oom_score_adj_min``) does. So the server keeps the score it was started with (the
``base``, 0 by default) and puts every runner above it:

- idle, unpinned runners in the upper half, least recently used at 1000;
- idle pinned runners below them;
- busy runners in the lower half, the one with the most requests in flight lowest, still
  above the server (a server killed takes every runner's requests with it).

A gap of half the range between idle and busy outweighs any difference in size up to half
the limit: the kernel takes an idle runner before a busy one that is smaller. With a base
at or near 1000 (a server started with ``oom_score_adj`` 1000) there is no room above it:
every runner gets 1000 and the kernel picks the largest (the order cannot be expressed
without privilege; the log says so once).
"""

from __future__ import annotations

from collections.abc import Sequence

from elbowroom.guard.ladder import LoadedModel

__all__ = ["MAX_ADJ", "kill_order"]

MAX_ADJ = 1000


def _spread(ids: Sequence[str], top: int, bottom: int) -> dict[str, int]:
    """``ids`` most killable first, from ``top`` down to ``bottom`` (inclusive), evenly."""
    if not ids:
        return {}
    if len(ids) == 1 or top <= bottom:
        return {i: top if n == 0 else max(bottom, top - n) for n, i in enumerate(ids)}
    step = (top - bottom) / (len(ids) - 1)
    return {i: round(top - n * step) for n, i in enumerate(ids)}


def kill_order(models: Sequence[LoadedModel], base: int) -> dict[str, int]:
    """``oom_score_adj`` per loaded model, every one in ``(base, 1000]`` when there is room
    (``base``: the server's own score)."""
    base = max(-1000, min(MAX_ADJ, base))
    if base >= MAX_ADJ - 1:
        return {m.id: MAX_ADJ for m in models}
    idle = sorted((m for m in models if m.busy == 0), key=lambda m: (m.pinned, m.last_used, m.id))
    # most killable first: fewest requests in flight, then least recently used
    busy = sorted((m for m in models if m.busy > 0), key=lambda m: (m.busy, m.last_used, m.id))
    mid = base + (MAX_ADJ - base + 1) // 2
    order = _spread([m.id for m in idle], MAX_ADJ, min(MAX_ADJ, mid + 1))
    order.update(_spread([m.id for m in busy], mid, base + 1))
    return order
