"""uvicorn's HTTP/1.1 connection (h11) with the two timeouts it lacks: for reading a request's head, and for a
client that stops reading its response.

uvicorn closes a connection only when it sits idle after a response (timeout_keep_alive). A connection that
never sends a complete head (slowloris: a header line every few seconds, or nothing at all) would stay open for
good, and a client that stops reading a stream would leave it decoding until max_tokens. Here:

- head timeout: from a connection's start, or from the first byte of the next request's head on a kept-alive
  one, the head must be complete within `head_timeout` seconds, or the connection is closed.
- send timeout: when the response cannot be written (the kernel's buffers and the transport's are full) for
  `send_timeout` seconds, the connection is dropped. The app sees a disconnect, as if the client had gone, and
  aborts the request's engine requests, which frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("pagoda.server")

# The kernel sizes a socket's send buffer up to megabytes (net.ipv4.tcp_wmem): a client that stopped reading
# would be sent that much (tens of thousands of streamed tokens) before a write ever waits. With the buffer set
# (the kernel doubles it) and a small transport buffer, a stalled client is noticed a few hundred kilobytes in;
# 64 KiB still fills a 100 ms round trip at half a megabyte a second.
_SEND_BUFFER_BYTES = 64 * 1024
_TRANSPORT_HIGH_WATER_BYTES = 16 * 1024


class TimeoutH11Protocol(H11Protocol):
    """H11Protocol with a head timeout and a send timeout; build one with `protocol_class`."""

    head_timeout: float | None = None
    send_timeout: float | None = None

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.send_timeout is not None:
            sock = transport.get_extra_info("socket")
            if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SEND_BUFFER_BYTES)
            transport.set_write_buffer_limits(high=_TRANSPORT_HIGH_WATER_BYTES)
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._in_request():
            self._cancel_head_timer()  # the head is complete; the app reads the body (bounded by its size limit)
        else:
            self._arm_head_timer()  # a kept-alive connection began its next head: it gets the same time

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        self._cancel_send_timer()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.send_timeout is not None and self._send_timer is None:
            self._send_timer = self.loop.call_later(self.send_timeout, self._on_send_timeout)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel_send_timer()

    def _in_request(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _arm_head_timer(self) -> None:
        if self.head_timeout is not None and self._head_timer is None and not self.transport.is_closing():
            self._head_timer = self.loop.call_later(self.head_timeout, self._on_head_timeout)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _cancel_send_timer(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _on_head_timeout(self) -> None:
        self._head_timer = None
        if not self._in_request():  # no log line: a flood of these would flood the log too
            self.transport.close()

    def _on_send_timeout(self) -> None:
        self._send_timer = None
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        log.info("%s has read nothing for %g s: dropping its connection", client, self.send_timeout)
        # abort(), not close(): close() would wait for the unread buffer to be sent first, that is, forever.
        self.transport.abort()


def protocol_class(head_timeout: float | None, send_timeout: float | None) -> type[TimeoutH11Protocol]:
    """The protocol class for uvicorn.Config(http=...), with these timeouts (None: none)."""
    return type(
        "TimeoutH11Protocol", (TimeoutH11Protocol,), {"head_timeout": head_timeout, "send_timeout": send_timeout}
    )
