"""Graceful termination: on SIGINT/SIGTERM new requests are refused, in-flight ones finish, and
whatever is still running at `--graceful-termination-timeout` ends with an error event.

Timeline after the signal, with timeout T and margin m = min(2 s, T / 5):
- at once: generation routes answer 503 (`Infer.draining`); uvicorn stops accepting
  connections and lets the open ones finish;
- at T - m: every admitted request still waiting or running gets a `shutdown` error event
  (streams send it, non-streaming requests answer 503);
- at T - m/2: uvicorn cancels what is left, before the launcher's SIGKILL at T.
"""

from __future__ import annotations

import asyncio
from types import FrameType

import uvicorn
from fastapi import FastAPI
from loguru import logger

from text_generation_router.engine.batcher import Batcher
from text_generation_router.engine.infer import Infer
from text_generation_router.http.connection import header_timeout_protocol


def margin_s(timeout_s: float) -> float:
    return min(2.0, timeout_s / 5)


class Drain:
    """What the router does between the termination signal and its exit."""

    def __init__(self, infer: Infer, batcher: Batcher, timeout_s: float) -> None:
        self.infer = infer
        self.batcher = batcher
        self.timeout_s = timeout_s
        self._deadline: asyncio.TimerHandle | None = None

    def begin(self) -> None:
        """Refuse new requests and arm the deadline (on the event loop's thread)."""
        if self.infer.draining:
            return
        self.infer.draining = True
        delay = max(self.timeout_s - margin_s(self.timeout_s), 0.0)
        logger.info("Shutting down: in-flight requests have {:.1f} s to finish", delay)
        self._deadline = asyncio.get_running_loop().call_later(delay, self._expire)

    def _expire(self) -> None:
        logger.warning("Graceful termination timeout: ending the requests still in flight")
        self.batcher.fail_all(
            "shutdown",
            f"the request did not finish within the graceful termination timeout ({self.timeout_s:g} s)",
        )


class GracefulServer(uvicorn.Server):
    """uvicorn's server, starting the drain when the termination signal arrives."""

    def __init__(self, config: uvicorn.Config, drain: Drain, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(config)
        self.drain = drain
        self.loop = loop

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A plain signal handler: hand the drain to the event loop's thread.
        self.loop.call_soon_threadsafe(self.drain.begin)
        super().handle_exit(sig, frame)


def server_config(app: FastAPI, host: str, port: int, timeout_s: float,
                  header_timeout_s: float) -> uvicorn.Config:
    """uvicorn settings: graceful timeout just under the launcher's, head deadline (connection.py)."""
    return uvicorn.Config(
        app, host=host, port=port, log_level="warning", access_log=False,
        # uvicorn hands this to asyncio.wait_for, which takes fractions of a second too.
        timeout_graceful_shutdown=timeout_s - margin_s(timeout_s) / 2,  # type: ignore[arg-type]
        http=header_timeout_protocol(header_timeout_s),
    )
