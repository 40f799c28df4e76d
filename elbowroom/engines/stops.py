"""Stop strings over a stream of text pieces: a pure helper for the LLM engine.

Text is emitted as soon as it can no longer be part of a stop string, so a client never
sees the beginning of a stop string that later completes, and never waits for text that
cannot be one.
"""

from __future__ import annotations


class StopScanner:
    """Feed decoded text pieces; get back the text that is safe to emit now.

    ``feed`` returns ``(text_to_emit, stopped)``. Once a stop string appears, the text
    before it is returned, ``stopped`` is True, and everything after it is dropped.
    ``flush`` returns what was held back (call it when generation ends for another reason).
    """

    __slots__ = ("_emitted", "_pending", "_stops", "stopped")

    def __init__(self, stops: tuple[str, ...] | list[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._pending = ""  # text not yet emitted: a possible start of a stop string
        self._emitted: list[str] = []
        self.stopped = False

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._emitted)

    def feed(self, piece: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        buf = self._pending + piece
        hits = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        if hits:
            out = buf[: min(hits)]
            self._pending = ""
            self.stopped = True
            return self._emit(out), True
        hold = self._partial_match(buf)
        self._pending = buf[len(buf) - hold :] if hold else ""
        return self._emit(buf[: len(buf) - hold]), False

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return self._emit(out) if not self.stopped else ""

    def _partial_match(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop."""
        best = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:k]):
                    best = k
                    break
        return best

    def _emit(self, text: str) -> str:
        if text:
            self._emitted.append(text)
        return text
