"""Continuous batching: the loop that drives Prefill/Decode/FilterBatch (docs/tgi-interface.md §1.5).

Design note: one batch is cached in the shard at a time. While it runs, the loop may
prefill a new batch from the queue (when the queue holds at least
`floor(size * waiting_served_ratio)` requests or after `max_waiting_tokens` decode steps
without an admission) and then decodes [running, new] together, which the shard merges under
the running batch's id. A shard that supports chunking (upstream v3's protocol) gets the new
batch in a Prefill together with the running one (`cached_batch`, one step for both, whose
answer is the running batch from then on) whenever the prefill budget left by the running
batch's next step admits any, then the Decode. After every step finished and abandoned
requests are removed with FilterBatch, or ClearCache when none is left; a paged shard's
requests hold KV blocks (`BlockAllocator`) from admission until they end.

Failure containment: a problem of one request ends that request alone. An entry that
cannot be encoded, or that the shard refuses (the `request_errors` extension), gets its own
error event and the rest of its batch runs on. Only a failed RPC, a shard fault, fails the
batches of that call (424). Every entry taken from the queue ends inside `_serve`: with its
last token or an error event, never by waiting forever.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from loguru import logger

from text_generation_router.config import ServingLimits
from text_generation_router.engine.block_allocator import BlockAllocator
from text_generation_router.engine.client import ShardClient, ShardError, StepResult
from text_generation_router.engine.dispatch import (
    CachedBatch,
    dispatch_generations,
    dispatch_request_errors,
    encode_requests,
    to_pb_batch,
)
from text_generation_router.engine.handshake import ShardInfo
from text_generation_router.engine.metrics import Metrics
from text_generation_router.engine.queue import Budget, Entry, Queue, release_blocks

T = TypeVar("T")
BATCH_FAILED = "the model server failed the batch this request was in (its log says why)"


class Health:
    """Set false by any generation error; /health then probes with a real Prefill."""

    def __init__(self) -> None:
        self.generation_ok = True


class Batcher:
    """Owns the queue's consumer side and the shard's batch cache."""

    def __init__(
        self,
        client: ShardClient,
        queue: Queue,
        shard: ShardInfo,
        limits: ServingLimits,
        metrics: Metrics,
        health: Health,
        scheduling: tuple[float, int, int | None],
        first_batch_id: int = 0,
    ) -> None:
        self.client = client
        self.queue = queue
        self.shard = shard
        self.limits = limits
        self.metrics = metrics
        self.health = health
        self.waiting_served_ratio, self.max_waiting_tokens, self.max_batch_size = scheduling
        self._next_batch_id = first_batch_id
        # Every entry taken from the queue for the batch being served, until it ends.
        self.in_flight: list[Entry] = []
        # a paged shard's KV blocks, counted here as upstream v3's router counts them
        # (block 0 is never handed out: one more, so that max_batch_total_tokens fit)
        self.blocks = None if shard.requires_padding else BlockAllocator(
            math.ceil(limits.max_batch_total_tokens / shard.block_size) + 1, shard.block_size,
            shard.use_prefix_caching)
        self._observe_blocks()

    def _budget(self, total_tokens: int, running_size: int, running_tokens: int = 0) -> Budget:
        max_size = None if self.max_batch_size is None else self.max_batch_size - running_size
        return Budget(
            prefill_tokens=self.limits.max_batch_prefill_tokens - running_tokens,
            total_tokens=total_tokens,
            max_size=max_size,
            block_size=self.shard.block_size,
            speculate=self.shard.speculate,
            chunking=self.shard.support_chunking,
        )

    def _observe_blocks(self) -> None:
        if self.blocks is not None:
            b = self.blocks
            for state, n in (("used", b.used), ("cached", b.cached), ("free", len(b.free))):
                self.metrics.kv_blocks.labels(state=state).set(n)

    def _prune(self) -> None:
        """Forget the entries that ended (a dropped one ends at its next generation); their KV
        blocks go back."""
        for entry in self.in_flight:
            if entry.done:
                release_blocks(entry, self.blocks)
        self.in_flight = [e for e in self.in_flight if not e.done]
        self._observe_blocks()

    async def run(self) -> None:
        """Serve the queue forever."""
        while True:
            await self.queue.notify.wait()
            self.queue.notify.clear()
            budget = self._budget(self.limits.max_batch_total_tokens, 0)
            while (entries := self.queue.next_batch(None, budget, self.blocks)) is not None:
                await self._serve(entries)
                budget = self._budget(self.limits.max_batch_total_tokens, 0)
            self.metrics.queue_size.set(len(self.queue))

    def fail_all(self, kind: str, message: str) -> None:
        """End every admitted request, running or waiting, with an error event."""
        for entry in self.in_flight:
            entry.fail(kind, message)
        self.queue.fail_all(kind, message)
        self.metrics.queue_size.set(0)

    async def _serve(self, first: list[Entry]) -> None:
        """Run one batch to completion; every entry taken from the queue ends in here.

        Each entry ends with its last token, its own error, or its batch's error; a router bug
        fails what is in flight, not the loop, and an entry left without an answer (a bug too)
        gets an error rather than waiting forever.
        """
        self.in_flight = list(first)
        try:
            await self._serve_entries({e.id: e for e in first})
        except Exception as err:  # noqa: BLE001 - the loop must survive to serve the queue
            logger.exception("batching step failed")
            self.health.generation_ok = False
            for entry in self.in_flight:
                entry.fail("generation", f"router error: {err}")
            with contextlib.suppress(ShardError):
                await self.client.clear_cache(None)
        finally:
            for entry in self.in_flight:
                entry.fail("incomplete", "the request ended without its last token")
            self._prune()
            self.metrics.batch_current_size.set(0)
            self.metrics.batch_current_max_tokens.set(0)

    async def _serve_entries(self, entries: dict[int, Entry]) -> None:
        """Run one batch to completion, admitting new requests while it runs."""
        cached = await self._prefill(entries)
        waiting_steps = 1
        while cached is not None:
            self.metrics.batch_current_size.set(cached.size)
            self.metrics.batch_current_max_tokens.set(cached.max_tokens)
            if self.shard.support_chunking:
                cached = await self._admit_chunking(cached, entries)
                if cached is None:
                    break
                batches = [cached]
            else:
                batches = [cached]
                new_cached, reason = await self._admit(cached, entries, waiting_steps)
                if new_cached is not None:
                    batches.append(new_cached)
                    self.metrics.batch_concat.labels(reason=reason).inc()
                    waiting_steps = 1
            cached = await self._decode(entries, batches)
            waiting_steps += 1

    async def _admit(
        self, cached: CachedBatch, entries: dict[int, Entry], waiting_steps: int
    ) -> tuple[CachedBatch | None, str]:
        """Prefill a new batch next to the running one when the queue warrants it."""
        if len(self.queue) == 0:
            return None, ""
        wait_exceeded = waiting_steps >= self.max_waiting_tokens
        min_size = None if wait_exceeded else math.floor(cached.size * self.waiting_served_ratio)
        total = self.limits.max_batch_total_tokens - cached.max_tokens
        new = self.queue.next_batch(min_size, self._budget(total, cached.size), self.blocks)
        self.metrics.queue_size.set(len(self.queue))
        if new is None:
            return None, ""
        self.in_flight.extend(new)
        new_entries = {e.id: e for e in new}
        new_cached = await self._prefill(new_entries)  # a failure here fails the new entries only
        entries.update(new_entries)
        return new_cached, "wait_exceeded" if wait_exceeded else "backpressure"

    async def _admit_chunking(self, cached: CachedBatch, entries: dict[int, Entry]) -> CachedBatch | None:
        """A chunking shard: new requests join the running batch in one Prefill with it, within
        the prefill budget its next step leaves (no waiting_served_ratio, as upstream); returns
        the running batch."""
        if len(self.queue) == 0:
            return cached
        total = self.limits.max_batch_total_tokens - cached.max_tokens
        new = self.queue.next_batch(None, self._budget(total, cached.size, cached.current_tokens), self.blocks)
        self.metrics.queue_size.set(len(self.queue))
        if new is None:
            return cached
        self.in_flight.extend(new)
        entries.update((e.id, e) for e in new)
        self.metrics.batch_concat.labels(reason="chunking").inc()
        return await self._prefill(entries, new, cached)

    async def _prefill(self, entries: dict[int, Entry], new: list[Entry] | None = None,
                       running: CachedBatch | None = None) -> CachedBatch | None:
        """Prefill the `new` entries (all `entries` by default) that can be encoded, the others
        having failed alone already; with `running`, in one step with that cached batch."""
        fresh = {e.id: e for e in new} if new is not None else entries
        requests = encode_requests(fresh)
        for entry in new or []:
            if entry.id not in fresh:  # failed alone
                entries.pop(entry.id, None)
        if not requests:
            return running
        batch = to_pb_batch(self._next_batch_id, list(fresh.values()), requests)
        self._next_batch_id += 1
        self.metrics.batch_next_size.observe(len(requests))
        ids = [batch.id] if running is None else [running.id, batch.id]
        return await self._step("prefill", entries, ids, self.client.prefill(batch, cached_batch=running))

    async def _decode(self, entries: dict[int, Entry], batches: list[CachedBatch]) -> CachedBatch | None:
        return await self._step("decode", entries, [b.id for b in batches], self.client.decode(batches))

    async def _step(
        self,
        method: str,
        entries: dict[int, Entry],
        batch_ids: list[int],
        call: Coroutine[Any, Any, StepResult],
    ) -> CachedBatch | None:
        """Run one shard step, hand out its tokens and shrink the cached batch."""
        self.metrics.batch_inference_count.labels(method=method).inc()
        started = time.monotonic()
        try:
            result = await call
        except ShardError as err:
            await self._fail(method, entries, batch_ids, err)
            return None
        self._observe(method, result, time.monotonic() - started)
        dispatch_request_errors(result.request_errors, entries)
        dispatch_generations(result.generations, entries, self.metrics)
        self._prune()  # before any answer is sent: a batch may run for hours
        self._fail_orphans(result.batch, entries)
        return await self._follow_up(method, result.batch, entries)

    def _fail_orphans(self, batch: CachedBatch | None, entries: dict[int, Entry]) -> None:
        """A live entry that the shard no longer holds would never get another token."""
        held = set(batch.request_ids) if batch is not None else set()
        for request_id in [i for i in entries if i not in held]:
            logger.error("request {} is no longer in the shard's batch", request_id)
            entries.pop(request_id).fail("incomplete", "the shard dropped the request")

    def _observe(self, method: str, result: StepResult, elapsed_s: float) -> None:
        m = self.metrics
        m.batch_inference_success.labels(method=method).inc()
        m.batch_inference_duration.labels(method=method).observe(elapsed_s)
        m.batch_forward_duration.labels(method=method).observe(result.forward_ns / 1e9)
        m.batch_decode_duration.labels(method=method).observe(result.decode_ns / 1e9)
        if result.concat_ns is not None:
            m.batch_concat_duration.labels(method="decode").observe(result.concat_ns / 1e9)
        m.set_shard_memory(result.memory)

    async def _follow_up(
        self, method: str, batch: CachedBatch | None, entries: dict[int, Entry]
    ) -> CachedBatch | None:
        """Router-side follow-up of docs/tgi-interface.md §1.5: ClearCache or FilterBatch as requests end."""
        if batch is None:
            return None
        if not entries:
            await self._guarded(self.client.clear_cache(batch.id), entries, [batch.id])
            return None
        if batch.size == len(entries):
            return batch
        live_ids = [i for i in batch.request_ids if i in entries]
        started = time.monotonic()
        filtered = await self._guarded(self.client.filter_batch(batch.id, live_ids), entries, [batch.id])
        self.metrics.batch_filter_duration.labels(method=method).observe(time.monotonic() - started)
        return filtered

    async def _guarded(
        self, call: Coroutine[Any, Any, T], entries: dict[int, Entry], batch_ids: list[int]
    ) -> T | None:
        try:
            return await call
        except ShardError as err:
            await self._fail("decode", entries, batch_ids, err)
            return None

    async def _fail(
        self, method: str, entries: dict[int, Entry], batch_ids: list[int], err: ShardError
    ) -> None:
        """A shard fault (its RPC failed): drop the batches in the shard and fail their requests.

        The shard's text is logged, not sent: it may name another request's values or a stack
        detail, and every request of the batch would read it."""
        logger.error("{} failed: {}", method, err.message)
        self.metrics.batch_inference_failure.labels(method=method).inc()
        self.health.generation_ok = False
        for entry in entries.values():
            entry.fail("generation", BATCH_FAILED)
        entries.clear()
        for batch_id in batch_ids:
            try:
                await self.client.clear_cache(batch_id)
            except ShardError as clear_err:
                logger.error("ClearCache({}) failed too: {}", batch_id, clear_err.message)
