"""The rule every memory prediction is held to: it may be over, never more than 5 % under.

An estimate that is under admits a model that does not fit, the failure elbowroom exists to
prevent; one that is over only leaves room unused. ``check`` is what the tests and the
benchmarks (``benchmarks/gpu_bench.py report``, ``benchmarks/cluster_memory.py``) apply to
every model, pool and build they measure; ``OVER_TARGET`` is the accuracy they aim for,
reported beside it (a prediction over by more is wasteful, not wrong).
"""

from __future__ import annotations

from dataclasses import dataclass

from elbowroom.units import format_size

__all__ = ["MAX_UNDER", "OVER_TARGET", "Accuracy", "check"]

MAX_UNDER = 0.05  # a prediction may be under the measurement by at most this share of it
OVER_TARGET = 0.10  # the aim on the other side: within 10 % over


@dataclass(frozen=True, slots=True)
class Accuracy:
    what: str
    predicted: int
    measured: int

    @property
    def error(self) -> float:
        """(predicted − measured) / measured: positive when over."""
        return (self.predicted - self.measured) / self.measured if self.measured else 0.0

    @property
    def ok(self) -> bool:
        """Not more than ``MAX_UNDER`` under (the rule)."""
        return self.error >= -MAX_UNDER

    @property
    def on_target(self) -> bool:
        """Within −MAX_UNDER … +OVER_TARGET (the rule and the aim)."""
        return self.ok and self.error <= OVER_TARGET

    def __str__(self) -> str:
        return (
            f"{self.what}: predicted {format_size(self.predicted)}, measured "
            f"{format_size(self.measured)} ({self.error:+.1%})"
        )


def check(what: str, predicted: int, measured: int) -> Accuracy:
    """``Accuracy`` of one prediction; raises AssertionError when it breaks the rule."""
    acc = Accuracy(what, predicted, measured)
    if not acc.ok:
        raise AssertionError(f"under-predicted by more than {MAX_UNDER:.0%}: {acc}")
    return acc
