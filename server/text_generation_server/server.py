"""The gRPC servicer of generate.v3.TextGenerationService and the `serve` loop.

Protobuf stays at this boundary: batches come in through `CausalLMBatch.from_pb`, and
`Generation` dataclasses go out through `generation_to_pb`. Errors: a `ValueError` (a bad
request) becomes INVALID_ARGUMENT with its message and the shard keeps serving; a
`RuntimeError` (a broken model or device state) becomes INTERNAL and stops the shard, as
upstream's does, so that the launcher notices; anything else becomes INTERNAL.

Request isolation (extension): when the router sets `per_request_errors` on Prefill/Decode, a
request with a bad value is refused alone in the response's `request_errors` and the rest of
the batch runs; without it (an upstream router) the whole RPC fails as upstream's would.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from grpc_reflection.v1alpha import reflection
from loguru import logger

from .engine import memory
from .engine.batch import CausalLMBatch, grammar_from_pb
from .engine.batch_cache import Cache
from .engine.causal_lm import CausalLM, Generation, TokenInfo
from .engine.skip_planner import PolicyState
from .env import ShardEnv
from .grammar_limits import GrammarLimits
from .pb import generate_pb2, generate_pb2_grpc
from .sampling import ChoiceContext

T = TypeVar("T")
R = TypeVar("R", generate_pb2.PrefillResponse, generate_pb2.DecodeResponse)


@dataclass(frozen=True)
class ServeConfig:
    """How the shard serves.

    Attributes:
        uds_path: base socket path; rank r listens on `{uds_path}-{r}`.
        max_input_tokens: initial limit on prompt tokens (Warmup may set it).
        dtype: the torch dtype string reported by Info.
        quantize: the loading strategy reported by Info ("" when none).
        grammar_limits: what a request's grammar may be, and how long it may compile.
    """

    uds_path: str = "/tmp/text-generation-server"
    max_input_tokens: int = 4095
    dtype: str = "torch.float32"
    quantize: str = ""
    grammar_limits: GrammarLimits = field(default_factory=GrammarLimits)

    def __post_init__(self) -> None:
        if self.max_input_tokens <= 0:
            raise ValueError(f"max_input_tokens must be positive, got {self.max_input_tokens}")


def tokens_to_pb(tokens: TokenInfo) -> generate_pb2.Tokens:
    return generate_pb2.Tokens(ids=tokens.ids, logprobs=tokens.logprobs, texts=tokens.texts,
                               is_special=tokens.is_special)


def generation_to_pb(g: Generation) -> generate_pb2.Generation:
    pb = generate_pb2.Generation(request_id=g.request_id, tokens=tokens_to_pb(g.tokens),
                                 top_tokens=[tokens_to_pb(t) for t in g.top_tokens])
    if g.prefill_tokens is not None:
        pb.prefill_tokens.CopyFrom(tokens_to_pb(g.prefill_tokens))
    if g.layer_skip is not None:
        r = g.layer_skip
        stats = {**{k: float(v) for k, v in r.scores.items()}, **r.stats}
        pb.layer_skip.CopyFrom(generate_pb2.LayerSkipReport(
            mode=r.mode, skipped_layers=r.skipped_layers, rule=r.rule, max_score=float(r.scores.get("max_score", 0.0)),
            mean_score=float(r.scores.get("mean_score", 0.0)), stats=stats))
    if g.cached_tokens is not None:
        pb.cached_tokens = g.cached_tokens
    if g.generated_text is not None:
        f = g.generated_text
        reason = generate_pb2.FinishReason.Name(int(f.finish_reason))
        pb.generated_text.CopyFrom(generate_pb2.GeneratedText(
            text=f.text, generated_tokens=f.generated_tokens, finish_reason=reason, seed=f.seed))
    return pb


class TextGenerationService(generate_pb2_grpc.TextGenerationServiceServicer):
    """Serves one CausalLM; model calls run one at a time, on the event loop's thread.

    They block the loop while they run, as upstream's shard does: the model was loaded on this
    thread, and OpenMP keeps one worker team per calling thread: a forward on a second thread
    would start a second team spinning on the same cores.
    """

    def __init__(self, model: CausalLM, config: ServeConfig, env: ShardEnv, shutdown: asyncio.Event) -> None:
        self.model = model
        self.config = config
        self.env = env
        self.cache = Cache()
        self.max_input_tokens = config.max_input_tokens
        self.lock = asyncio.Lock()
        self.shutdown = shutdown
        self.choice = ChoiceContext(model.grammar_compiler(config.grammar_limits), env.watermark)

    async def _call(self, context: grpc.aio.ServicerContext, fn: Callable[..., T], *args: Any) -> T:
        try:
            async with self.lock:
                return fn(*args)
        except ValueError as err:
            logger.warning(f"Bad request: {err}")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except RuntimeError as err:
            logger.exception(f"Model error, shutting the shard down: {err}")
            self.shutdown.set()
            await context.abort(grpc.StatusCode.INTERNAL, str(err))
        except Exception as err:
            logger.exception(f"Error: {err}")
            # the client's text stays plain: the traceback and the exception's words are in this log
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {fn.__name__.strip('_')}")
        raise AssertionError("context.abort returns only by raising")

    async def Info(self, request: generate_pb2.InfoRequest,
                   context: grpc.aio.ServicerContext) -> generate_pb2.InfoResponse:
        planner = self.model.planner
        # paged KV, prompts in chunks (Prefill with cached_batch) and prefix reuse, as upstream's v3
        # flash shards: the router's blocks are its accounting, the shard's pools hold the KV
        return generate_pb2.InfoResponse(
            requires_padding=False, dtype=self.config.dtype, device_type=self.model.runner.device.type,
            speculate=self.model.speculate,  # the most draft tokens a step verifies (upstream's meaning)
            support_chunking=self.model.prefill_chunk > 0, use_prefix_caching=self.model.prefixes is not None,
            attention_impl=self.env.attention, block_size=self.env.block_size,
            runner=self.model.runner.name, quantize=self.config.quantize,
            layer_skip_mode=planner.mode, layer_skip_policy=planner.config.policy_path or "",
            layer_skip_policy_state=planner.policy_state, num_layers=self.model.runner.num_layers,
            cpu_kernels=self.model.runner.cpu_kernels,
        )

    async def Health(self, request: generate_pb2.HealthRequest,
                     context: grpc.aio.ServicerContext) -> generate_pb2.HealthResponse:
        return generate_pb2.HealthResponse()

    async def ServiceDiscovery(self, request: generate_pb2.ServiceDiscoveryRequest,
                               context: grpc.aio.ServicerContext) -> generate_pb2.ServiceDiscoveryResponse:
        urls = [f"unix://{self.config.uds_path}-{rank}" for rank in range(self.env.world_size)]
        return generate_pb2.ServiceDiscoveryResponse(urls=urls)

    async def ClearCache(self, request: generate_pb2.ClearCacheRequest,
                         context: grpc.aio.ServicerContext) -> generate_pb2.ClearCacheResponse:
        if request.HasField("id"):
            self.cache.delete(request.id)
        else:
            self.cache.clear()
        return generate_pb2.ClearCacheResponse()

    async def FilterBatch(self, request: generate_pb2.FilterBatchRequest,
                          context: grpc.aio.ServicerContext) -> generate_pb2.FilterBatchResponse:
        return await self._call(context, self._filter, request)

    def _filter(self, request: generate_pb2.FilterBatchRequest) -> generate_pb2.FilterBatchResponse:
        batch = self.cache.pop(request.batch_id)
        try:
            filtered = batch.filter(list(request.request_ids))
        except ValueError:
            self.cache.set(batch)  # a bad filter request leaves the batch as it was
            raise
        self.cache.set(filtered)
        return generate_pb2.FilterBatchResponse(batch=filtered.to_pb(self.model.prefill_chunk))

    async def Warmup(self, request: generate_pb2.WarmupRequest,
                     context: grpc.aio.ServicerContext) -> generate_pb2.WarmupResponse:
        return await self._call(context, self._warmup, request)

    def _warmup(self, request: generate_pb2.WarmupRequest) -> generate_pb2.WarmupResponse:
        max_input = request.max_input_tokens if request.HasField("max_input_tokens") else None
        self.max_input_tokens = max(self.max_input_tokens, max_input or 0)
        warmup_batch = generate_pb2.Batch()
        warmup_batch.CopyFrom(request.batch)
        for r in warmup_batch.requests:  # upstream's router warms up with watermark on: a dry run
            r.parameters.watermark = False
        batch = self._from_pb(warmup_batch)
        padded_tokens = batch.padded_prompt_tokens()
        prompt_tokens, start = sum(r.input_length for r in batch.requests), time.perf_counter()
        self.model.generate_token(batch)  # a dry run; the result is not cached
        while any(group.fresh for group in batch.groups):  # a prefill in chunks: to its last one
            # minutes on quantized weights: say how far it is
            left = sum(int(group.pending_mask.sum()) for group in batch.groups if group.fresh)
            logger.info(f"Warm-up: {prompt_tokens - left:,} of {prompt_tokens:,} prompt tokens prefilled in "
                        f"{time.perf_counter() - start:.0f} s")
            self.model.generate_token(batch)
        if self.model.prefixes is not None:
            self.model.prefixes.clear()  # nor are its prompts
        if self.model.planner.policy_state == PolicyState.LOADED:
            cost = self.model.costs()
            logger.info(f"Verified-mode cost model: step {cost.step_s * 1000:.1f} ms, verify "
                        f"{[round(t * 1000, 1) for t in cost.verify_s]} ms, {cost.layer_s * 1000:.2f} ms/layer")
        max_total = request.max_total_tokens if request.HasField("max_total_tokens") else padded_tokens
        max_input = max_input if max_input is not None else max_total - 1
        self.max_input_tokens = max_input
        logger.info(f"Warmup done: {padded_tokens} padded tokens, max_input={max_input}, max_total={max_total}")
        memory.release_free_memory()
        found = self.model.memory()
        logger.info(f"Memory after warm-up: {memory.describe(found)}")
        return generate_pb2.WarmupResponse(max_input_tokens=max_input, max_total_tokens=max_total,
                                           memory_bytes=found)

    def _from_pb(self, pb: generate_pb2.Batch) -> CausalLMBatch:
        return CausalLMBatch.from_pb(pb, self.model.tokenizer, self.model.runner.num_layers,
                                     self.model.eos_token_ids, self.max_input_tokens, self.choice)

    async def PrepareGrammar(self, request: generate_pb2.PrepareGrammarRequest,
                             context: grpc.aio.ServicerContext) -> generate_pb2.PrepareGrammarResponse:
        try:
            spec = grammar_from_pb(request.grammar_type, request.grammar)
            if spec is not None:
                await self.choice.prepare(spec)
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        return generate_pb2.PrepareGrammarResponse()

    async def Prefill(self, request: generate_pb2.PrefillRequest,
                      context: grpc.aio.ServicerContext) -> generate_pb2.PrefillResponse:
        start_ns = time.perf_counter_ns()
        await self._prepare_grammars(request.batch)
        return await self._call(context, self._prefill, request, start_ns)

    async def _prepare_grammars(self, batch: generate_pb2.Batch) -> None:
        """Compile the batch's grammars off the step thread before the step takes it (our router
        prepared them already; an upstream router did not). A refusal is left for the step, which
        refuses its request alone (or the RPC, for a router that did not ask for isolation)."""
        async def prepare(r: generate_pb2.Request) -> None:
            with contextlib.suppress(ValueError):
                spec = grammar_from_pb(r.parameters.grammar_type, r.parameters.grammar)
                if spec is not None:
                    await self.choice.prepare(spec)

        await asyncio.gather(*(prepare(r) for r in batch.requests if r.parameters.grammar))

    def _prefill(self, request: generate_pb2.PrefillRequest, start_ns: int) -> generate_pb2.PrefillResponse:
        """A new batch's first step; with `cached_batch` (a router of the chunking protocol), in
        one step with that running batch, which the new requests join under its id."""
        isolated = request.per_request_errors
        refused: list[tuple[int, str]] = []
        if isolated:
            batch, refused = CausalLMBatch.from_pb_isolated(
                request.batch, self.model.tokenizer, self.model.runner.num_layers, self.model.eos_token_ids,
                self.max_input_tokens, self.choice)
            for request_id, message in refused:
                logger.warning(f"Request {request_id} refused: {message}")
        else:
            batch = self._from_pb(request.batch)
        concat_ns = None
        if request.HasField("cached_batch") and self.model.prefill_chunk > 0:
            running = self.cache.pop_all([request.cached_batch.id])[0]  # after the new batch is read
            if batch is not None:
                try:
                    self.model.plan(batch)
                except Exception:
                    self.cache.set(running)  # the running batch is not lost with the new one
                    raise
                concat_start = time.perf_counter_ns()
                batch = CausalLMBatch.concatenate([running, batch])
                concat_ns = time.perf_counter_ns() - concat_start
            else:
                batch = running
        if batch is None:
            out = generate_pb2.PrefillResponse(total_ns=time.perf_counter_ns() - start_ns)
        else:
            out = self._step(batch, generate_pb2.PrefillResponse, start_ns, concat_ns, isolated)
        out.request_errors.extend(generate_pb2.RequestError(request_id=i, message=m) for i, m in refused)
        return out

    async def Decode(self, request: generate_pb2.DecodeRequest,
                     context: grpc.aio.ServicerContext) -> generate_pb2.DecodeResponse:
        return await self._call(context, self._decode, request, time.perf_counter_ns())

    def _decode(self, request: generate_pb2.DecodeRequest, start_ns: int) -> generate_pb2.DecodeResponse:
        if not request.batches:
            raise ValueError("Decode needs at least one batch")
        batches = self.cache.pop_all([b.id for b in request.batches])
        isolated = request.per_request_errors
        if len(batches) == 1:
            return self._step(batches[0], generate_pb2.DecodeResponse, start_ns, per_request_errors=isolated)
        concat_start = time.perf_counter_ns()
        batch = CausalLMBatch.concatenate(batches)
        concat_ns = time.perf_counter_ns() - concat_start
        return self._step(batch, generate_pb2.DecodeResponse, start_ns, concat_ns, isolated)

    def _step(self, batch: CausalLMBatch, response: type[R], start_ns: int, concat_ns: int | None = None,
              per_request_errors: bool = False) -> R:
        """One generate_token step; caches the batch that goes on and builds the response.

        A request that failed alone in the step is reported in `request_errors` when the router
        asked for that, else the RPC fails naming it (upstream's behaviour).
        """
        generations, next_batch, timings = self.model.generate_token(batch)
        logger.debug("Step of batch {}: plan {} ns, forward {} ns, choose {} ns, stop {} ns", batch.batch_id,
                     timings.plan_ns, timings.forward_ns, timings.choose_ns, timings.stop_ns)
        self.cache.set(next_batch)
        if next_batch is None:  # every request ended: their blocks go back before memory is reported
            batch.release_kv()
        failed = [g for g in generations if g.error is not None]
        if failed and not per_request_errors:
            raise ValueError(f"request {failed[0].request_id}: {failed[0].error}")
        out = response(generations=[generation_to_pb(g) for g in generations if g.error is None],
                       forward_ns=timings.forward_ns, decode_ns=timings.decode_ns,
                       request_errors=[generate_pb2.RequestError(request_id=g.request_id, message=g.error or "")
                                       for g in failed])
        if next_batch is not None:
            out.batch.CopyFrom(next_batch.to_pb(self.model.prefill_chunk))
        if concat_ns is not None:
            out.concat_ns = concat_ns
        out.memory_bytes.update(memory.serving(self.model.pools, self.model.prefixes))
        out.total_ns = time.perf_counter_ns() - start_ns
        return out


async def serve_model(model: CausalLM, config: ServeConfig, env: ShardEnv) -> None:
    """Bind `{uds_path}-{rank}` once the model is loaded and serve until SIGINT/SIGTERM."""
    shutdown = asyncio.Event()
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 2**31 - 1),
                                      ("grpc.max_send_message_length", 2**31 - 1)])
    generate_pb2_grpc.add_TextGenerationServiceServicer_to_server(
        TextGenerationService(model, config, env, shutdown), server)
    service_names = (generate_pb2.DESCRIPTOR.services_by_name["TextGenerationService"].full_name,
                     reflection.SERVICE_NAME)
    reflection.enable_server_reflection(service_names, server)
    socket_path = f"{config.uds_path}-{env.rank}"
    if os.path.exists(socket_path):
        os.unlink(socket_path)
    server.add_insecure_port(f"unix://{socket_path}")
    await server.start()
    logger.info(f"Server started at unix://{socket_path}")
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, shutdown.set)
    await shutdown.wait()
    logger.info("Signal received. Shutting down")
    await server.stop(grace=5)
