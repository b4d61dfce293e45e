"""`--prometheus-port`: the Prometheus text of GET /metrics on a port of its own.

Upstream's router configures this listener but drops it; here it serves, as the flag says, the
same text as the main port's /metrics. A port that cannot be bound (another router holds it)
is logged and skipped: the main port's /metrics still serves.
"""

from __future__ import annotations

import asyncio
import contextlib

from loguru import logger

from text_generation_router.engine.metrics import Metrics, render

MAX_HEAD_BYTES = 16384


async def serve_metrics(metrics: Metrics, hostname: str, port: int) -> asyncio.Server | None:
    """Start the listener; None when the port cannot be bound."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            writer.close()
            return
        request_line = head.split(b"\r\n", 1)[0].split()
        if len(request_line) >= 2 and request_line[0] in (b"GET", b"HEAD") and request_line[1].split(b"?")[0] in (
                b"/metrics", b"/"):
            status, body = b"200 OK", render(metrics)
        else:
            status, body = b"404 Not Found", b"not found\n"
        writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n"
                     + (b"" if request_line[:1] == [b"HEAD"] else body))
        with contextlib.suppress(ConnectionError):  # the scraper left: nothing to answer
            await writer.drain()
        writer.close()

    try:
        server = await asyncio.start_server(handle, hostname, port, limit=MAX_HEAD_BYTES)
    except OSError as err:
        logger.warning("--prometheus-port {}: cannot listen ({}); /metrics on the main port still serves", port, err)
        return None
    logger.info("Prometheus metrics on {}:{}/metrics", hostname, port)
    return server
