"""A deadline on the request head: uvicorn's h11 protocol that closes a connection gone silent.

uvicorn's keep-alive timer starts only after a response and any byte cancels it, so a client that
connects and says nothing, or trickles its header bytes, holds a socket (a file descriptor) for as
long as it likes. `header_timeout_protocol(seconds)` is the protocol class `astrai serve` hands to
uvicorn (cli.py's `uvicorn_config`, `--header_timeout`): from the connection opening, and again
after each response, a complete request head must arrive within that time or the connection is
closed. The body has its own timeout in the app (`--body_timeout`).
"""

from __future__ import annotations

import asyncio
from typing import Any


def header_timeout_protocol(header_timeout: float) -> type:
    """uvicorn's h11 protocol with a deadline on the request head: the connection is closed when
    no complete request head arrives within `header_timeout` seconds of the connection opening or
    of the previous response. uvicorn's own keep-alive timer starts only after a response and is
    cancelled by any byte, so a silent or trickling client would otherwise hold its socket forever."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _idle_cycle: Any = None  # the request cycle that was current when the deadline was armed

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm_header_deadline()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_deadline()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            if self._header_timer is not None and self.cycle is not self._idle_cycle:
                self._disarm_header_deadline()  # a request head arrived: the body has its own timeout

        def on_response_complete(self) -> None:
            if not self.transport.is_closing():  # armed first: a pipelined request started below disarms it
                self._arm_header_deadline()
            super().on_response_complete()

        def _arm_header_deadline(self) -> None:
            self._disarm_header_deadline()
            self._idle_cycle = self.cycle
            self._header_timer = self.loop.call_later(header_timeout, self._header_deadline)

        def _disarm_header_deadline(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_deadline(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol
