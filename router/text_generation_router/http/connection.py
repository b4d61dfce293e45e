"""HTTP connections: a deadline for request heads, and dropping requests whose client left.

Upstream's hyper server closes a connection whose request head does not arrive in time;
uvicorn's h11 protocol only times out idle keep-alive connections, so a client that sends a
partial head (or nothing) holds its connection forever. `header_timeout_protocol` adds that
deadline. `unless_disconnected` runs a non-streaming handler's work until it finishes or its
client goes away; then the work is cancelled, which drops the request at the batcher's next
step (streaming responses get the same from Starlette, which cancels the stream).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any, TypeVar

import h11
from fastapi import Request
from uvicorn.protocols.http.h11_impl import H11Protocol

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its answer was ready; nobody reads the response."""


def header_timeout_protocol(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request head is not complete within
    `timeout_s` of the connection opening or of the head's first byte."""

    class HeaderTimeoutProtocol(H11Protocol):
        _head_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE:
                self._arm()  # (part of) a head is waiting
            else:
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._head_deadline is None and not self.transport.is_closing():
                self._head_deadline = self.loop.call_later(timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._head_deadline is not None:
                self._head_deadline.cancel()
                self._head_deadline = None

        def _expire(self) -> None:
            self._head_deadline = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """The result of `work`, or ClientGone once its client disconnected (work is cancelled)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise ClientGone()
    return task.result()
