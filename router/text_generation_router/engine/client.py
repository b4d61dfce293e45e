"""Async gRPC client of one or more generate.v3 shards over unix sockets.

Every RPC goes to all shards in parallel (docs/tgi-interface.md §1.4 step 2); generations are concatenated,
other answers are taken from the first shard. Idempotent calls are retried when the
channel reports UNAVAILABLE, because an idle unix channel can drop its connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import grpc
import grpc.aio

from text_generation_router.pb import generate_pb2 as pb
from text_generation_router.pb import generate_pb2_grpc as pb_grpc

T = TypeVar("T")
RETRIES = 3
RETRY_DELAY_S = 0.2


class ShardError(RuntimeError):
    """A shard RPC failed; `message` is the gRPC status detail, `code` its status."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def _strip_unix(url: str) -> str:
    return url.removeprefix("unix://")


class ShardClient:
    """Client of every shard of one model (rank 0 first)."""

    def __init__(self, uds_paths: list[str]) -> None:
        assert uds_paths, "at least one shard socket is needed"
        self.uds_paths = uds_paths
        self._channels = [grpc.aio.insecure_channel(f"unix://{p}") for p in uds_paths]
        self._stubs = [pb_grpc.TextGenerationServiceStub(c) for c in self._channels]
        self._prepares_grammars = True  # until a shard answers PrepareGrammar with UNIMPLEMENTED

    @classmethod
    async def connect(cls, master_uds_path: str) -> ShardClient:
        """Dial shard 0, then every shard it lists (ServiceDiscovery)."""
        master = cls([master_uds_path])
        try:
            answer = await master._call_one(
                lambda s: s.ServiceDiscovery(pb.ServiceDiscoveryRequest()), idempotent=True
            )
        except ShardError as err:
            raise RuntimeError(f"Server does not support v3 interface: {err.message}") from err
        urls = [_strip_unix(u) for u in answer.urls] or [master_uds_path]
        await master.close()
        return cls(urls)

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._channels))

    async def _call_one(
        self,
        call: Callable[[pb_grpc.TextGenerationServiceStub], Awaitable[T]],
        idempotent: bool,
        index: int = 0,
    ) -> T:
        attempts = RETRIES if idempotent else 1
        for attempt in range(attempts):
            try:
                return await call(self._stubs[index])
            except grpc.aio.AioRpcError as err:
                retry = err.code() == grpc.StatusCode.UNAVAILABLE and attempt + 1 < attempts
                if not retry:
                    raise ShardError(err.details() or str(err.code()), err.code()) from err
                await asyncio.sleep(RETRY_DELAY_S * (attempt + 1))
        raise AssertionError("unreachable: the retry loop returns or raises")

    async def _call_all(
        self,
        call: Callable[[pb_grpc.TextGenerationServiceStub], Awaitable[T]],
        idempotent: bool,
    ) -> list[T]:
        return list(
            await asyncio.gather(
                *(self._call_one(call, idempotent, i) for i in range(len(self._stubs)))
            )
        )

    async def clear_cache(self, batch_id: int | None) -> None:
        request = pb.ClearCacheRequest() if batch_id is None else pb.ClearCacheRequest(id=batch_id)
        await self._call_all(lambda s: s.ClearCache(request), idempotent=True)

    async def info(self) -> pb.InfoResponse:
        return (await self._call_all(lambda s: s.Info(pb.InfoRequest()), idempotent=True))[0]

    async def health(self) -> None:
        await self._call_all(lambda s: s.Health(pb.HealthRequest()), idempotent=True)

    async def warmup(self, request: pb.WarmupRequest) -> list[pb.WarmupResponse]:
        return await self._call_all(lambda s: s.Warmup(request), idempotent=False)

    async def filter_batch(self, batch_id: int, request_ids: list[int]) -> pb.CachedBatch:
        request = pb.FilterBatchRequest(batch_id=batch_id, request_ids=request_ids)
        answers = await self._call_all(lambda s: s.FilterBatch(request), idempotent=False)
        return answers[0].batch

    async def prepare_grammar(self, grammar: str, grammar_type: int) -> str | None:
        """Have every shard compile a request's grammar (extension); returns the shard's refusal
        (a grammar that does not compile, is over its limits or its deadline), None once compiled.
        A shard without the extension (upstream's) compiles at Prefill instead; any other failure
        is left for the Prefill to meet."""
        if not self._prepares_grammars:
            return None
        request = pb.PrepareGrammarRequest(grammar=grammar, grammar_type=grammar_type)  # type: ignore[arg-type]
        try:
            await self._call_all(lambda s: s.PrepareGrammar(request), idempotent=True)
        except ShardError as err:
            if err.code == grpc.StatusCode.INVALID_ARGUMENT:
                return err.message
            if err.code == grpc.StatusCode.UNIMPLEMENTED:
                self._prepares_grammars = False
        return None

    async def prefill(self, batch: pb.Batch, per_request_errors: bool = True,
                      cached_batch: pb.CachedBatch | None = None) -> StepResult:
        """Prefill a batch (with `cached_batch`, a chunking shard's running batch, in one step with
        it); by default a request the shard refuses fails alone (extension)."""
        request = pb.PrefillRequest(batch=batch, per_request_errors=per_request_errors, cached_batch=cached_batch)
        return _merge(await self._call_all(lambda s: s.Prefill(request), idempotent=False))

    async def decode(self, batches: list[pb.CachedBatch]) -> StepResult:
        request = pb.DecodeRequest(batches=batches, per_request_errors=True)
        return _merge(await self._call_all(lambda s: s.Decode(request), idempotent=False))


class StepResult:
    """Generations of one Prefill/Decode from all shards, and the batch left cached."""

    def __init__(
        self,
        generations: list[pb.Generation],
        batch: pb.CachedBatch | None,
        forward_ns: int,
        decode_ns: int,
        total_ns: int,
        concat_ns: int | None,
        request_errors: list[tuple[int, str]],
        memory: dict[str, int],
    ) -> None:
        self.generations = generations
        self.memory = memory  # bytes by part, summed over shards (extension; empty from upstream's shard)
        self.request_errors = request_errors  # (request id, message) refused alone
        self.batch = batch
        self.forward_ns = forward_ns
        self.decode_ns = decode_ns
        self.total_ns = total_ns
        self.concat_ns = concat_ns


def _merge(answers: list[pb.PrefillResponse] | list[pb.DecodeResponse]) -> StepResult:
    first = answers[0]
    generations = [g for answer in answers for g in answer.generations]
    return StepResult(
        generations=generations,
        batch=first.batch if first.HasField("batch") else None,
        forward_ns=first.forward_ns,
        decode_ns=first.decode_ns,
        total_ns=first.total_ns,
        concat_ns=first.concat_ns if first.HasField("concat_ns") else None,
        request_errors=[(e.request_id, e.message) for answer in answers for e in answer.request_errors],
        memory=memory_bytes(answers),
    )


def memory_bytes(answers: Sequence[pb.PrefillResponse | pb.DecodeResponse | pb.WarmupResponse]) -> dict[str, int]:
    """The shards' `memory_bytes` extension, summed by part."""
    total: dict[str, int] = {}
    for answer in answers:
        for part, value in answer.memory_bytes.items():
            total[part] = total.get(part, 0) + value
    return total
