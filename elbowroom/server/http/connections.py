"""Connections that never finish (docs/security.md "Connections").

uvicorn times out an idle keep-alive connection but not one that is still sending its
request head: ~20,000 half-sent requests used up the process's open files, and then
``/health``, the memory monitor and new runners all failed with "Too many open files".
The HTTP protocol here is uvicorn's own (httptools or h11, whichever ``auto`` picks) with
two additions:

- ``header_timeout``: a request head (request line and headers) must be complete within
  this many seconds of its first byte (or of the connection); otherwise the connection is
  closed. The body has its own timeout (``body_timeout``, in the body gate).
- ``max_connections``: connections open at once. One more closes the oldest connection
  still sending its request head; when every connection has sent its head, the new one is
  answered ``503`` and closed at once. The default (0) is the soft open-file limit less a reserve
  (``FD_RESERVE``, or a quarter of the limit when that is more) kept for the memory
  monitor, the runners' pipes and sockets, model files and logs.
"""

from __future__ import annotations

import asyncio
import resource
from collections import OrderedDict
from typing import Any

from elbowroom.config import Settings

FD_RESERVE = 256
_REFUSED_BODY = (
    b'{"error": {"message": "too many open connections (max_connections); retry shortly", '
    b'"type": "service_unavailable", "code": "too_many_connections"}}'
)
_REFUSED = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    b"connection: close\r\nretry-after: 1\r\ncontent-length: %d\r\n\r\n%s"
    % (len(_REFUSED_BODY), _REFUSED_BODY)
)


def connection_cap(settings: Settings) -> int:
    """``max_connections``, or what the open-file limit leaves after the reserve."""
    if settings.max_connections:
        return settings.max_connections
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(16, soft - max(FD_RESERVE, soft // 4))


def protocol_class(settings: Settings) -> type[asyncio.Protocol]:
    """uvicorn's ``auto`` HTTP protocol with a header timeout and a connection cap."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    base: Any = AutoHTTPProtocol
    cap = connection_cap(settings)
    timeout = settings.header_timeout

    pending: OrderedDict[Any, None] = OrderedDict()  # connections still sending a head

    class Bounded(base):  # type: ignore[misc]
        _head_timer: asyncio.TimerHandle | None = None
        _armed_cycle: Any = None

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > cap:
                # Make room by closing the oldest connection that has not finished its
                # request head yet (a slow or stalled client); with none, refuse this one.
                if pending:
                    oldest, _ = pending.popitem(last=False)
                    oldest._close_unfinished()
                else:
                    transport.write(_REFUSED)
                    transport.close()
                    return
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._head_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm()  # the first bytes of the next request on a kept-alive connection
            super().data_received(data)
            if self._head_timer is not None and self.cycle is not self._armed_cycle:
                self._disarm()  # the head is complete

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._armed_cycle = self.cycle
            self._head_timer = asyncio.get_running_loop().call_later(timeout, self._expire)
            pending[self] = None

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            pending.pop(self, None)

        def _expire(self) -> None:
            self._head_timer = None
            pending.pop(self, None)
            if self.cycle is self._armed_cycle:
                self._close_unfinished()  # no request head completed in time

        def _close_unfinished(self) -> None:
            self._disarm()
            if not self.transport.is_closing():
                self.transport.close()

    return Bounded
