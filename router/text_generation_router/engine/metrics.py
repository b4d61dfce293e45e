"""Prometheus series with upstream's names, labels and buckets (docs/tgi-interface.md §4)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from .layer_skip_metrics import LayerSkipMetrics

# Every `*_duration` series: 35 geometric buckets from 1.5e-4 s, ratio 1.5.
DURATION_BUCKETS = tuple(1.5e-4 * 1.5**i for i in range(35))
BATCH_SIZE_BUCKETS = tuple(float(i) for i in range(1, 1025))  # 1, 2, 3 .. 1024, as upstream


def _linear(upper: int) -> tuple[float, ...]:
    step = max(upper, 1) / 100
    return tuple(step * (i + 1) for i in range(100))


# Upstream's Rust exporter writes counters without the `_total` suffix that
# prometheus-client adds, so counters are gauges that only go up, re-typed when rendered.
COUNTER_NAMES: list[str] = []


def _counter(name: str, doc: str, labels: tuple[str, ...] = (), *, registry: CollectorRegistry) -> Gauge:
    if name not in COUNTER_NAMES:
        COUNTER_NAMES.append(name)
    return Gauge(name, doc, labels, registry=registry)


def render(metrics: Metrics) -> bytes:
    """Prometheus text exposition with upstream's series names."""
    text = generate_latest(metrics.registry).decode()
    for name in COUNTER_NAMES:
        text = text.replace(f"# TYPE {name} gauge", f"# TYPE {name} counter")
    return text.encode()


@dataclass
class Metrics:
    """All router series, registered in one private registry."""

    registry: CollectorRegistry
    request_count: Gauge
    request_success: Gauge
    request_failure: Gauge
    request_duration: Histogram
    request_validation_duration: Histogram
    request_queue_duration: Histogram
    request_inference_duration: Histogram
    request_mean_time_per_token_duration: Histogram
    request_generated_tokens: Histogram
    request_input_length: Histogram
    request_max_new_tokens: Histogram
    request_skipped_tokens: Histogram
    request_prefix_cached_tokens: Histogram
    queue_size: Gauge
    batch_current_size: Gauge
    batch_current_max_tokens: Gauge
    batch_max_total_tokens: Gauge
    kv_blocks: Gauge
    batch_next_size: Histogram
    batch_inference_count: Gauge
    batch_inference_success: Gauge
    batch_inference_failure: Gauge
    batch_inference_duration: Histogram
    batch_forward_duration: Histogram
    batch_decode_duration: Histogram
    batch_filter_duration: Histogram
    batch_concat: Gauge
    batch_concat_duration: Histogram
    layer_skip: LayerSkipMetrics
    shard_memory: Gauge  # bytes by part, summed over shards (extension)

    def set_shard_memory(self, found: dict[str, int]) -> None:
        for part, value in found.items():
            self.shard_memory.labels(part=part).set(value)


def build_metrics(max_input_tokens: int, max_total_tokens: int) -> Metrics:
    """Create the series; token-length buckets depend on the limits fixed at warmup."""
    disable_created_metrics()
    r = CollectorRegistry()

    def duration(name: str, doc: str, labels: tuple[str, ...] = ()) -> Histogram:
        return Histogram(name, doc, labels, registry=r, buckets=DURATION_BUCKETS)

    method = ("method",)
    return Metrics(
        registry=r,
        request_count=_counter("tgi_request_count", "Requests received", registry=r),
        request_success=_counter("tgi_request_success", "Successful requests", registry=r),
        request_failure=_counter("tgi_request_failure", "Failed requests", ("err",), registry=r),
        request_duration=duration("tgi_request_duration", "Request duration"),
        request_validation_duration=duration("tgi_request_validation_duration", "Validation"),
        request_queue_duration=duration("tgi_request_queue_duration", "Time in queue"),
        request_inference_duration=duration("tgi_request_inference_duration", "Inference"),
        request_mean_time_per_token_duration=duration(
            "tgi_request_mean_time_per_token_duration", "Mean time per token"
        ),
        request_generated_tokens=Histogram(
            "tgi_request_generated_tokens", "Generated tokens", registry=r,
            buckets=_linear(max_total_tokens),
        ),
        request_input_length=Histogram(
            "tgi_request_input_length", "Input tokens", registry=r,
            buckets=_linear(max_input_tokens),
        ),
        request_max_new_tokens=Histogram(
            "tgi_request_max_new_tokens", "Requested max_new_tokens", registry=r,
            buckets=_linear(max_total_tokens),
        ),
        request_skipped_tokens=Histogram(
            "tgi_request_skipped_tokens", "Speculated tokens", registry=r
        ),
        request_prefix_cached_tokens=Histogram(
            "tgi_request_prefix_cached_tokens", "Prompt tokens taken from the prefix cache", registry=r,
            buckets=_linear(max_input_tokens),
        ),
        queue_size=Gauge("tgi_queue_size", "Waiting requests", registry=r),
        batch_current_size=Gauge("tgi_batch_current_size", "Running batch size", registry=r),
        batch_current_max_tokens=Gauge(
            "tgi_batch_current_max_tokens", "Running batch max tokens", registry=r
        ),
        batch_max_total_tokens=Gauge(
            "tgi_batch_max_total_tokens", "Token budget of all batches", registry=r
        ),
        kv_blocks=Gauge("tgi_kv_blocks", "A paged shard's KV blocks as the router counts them: used by "
                        "requests, cached (prompt prefixes in the trie, held by requests or not), free",
                        ["state"], registry=r),
        batch_next_size=Histogram(
            "tgi_batch_next_size", "New batch size", registry=r, buckets=BATCH_SIZE_BUCKETS
        ),
        batch_inference_count=_counter("tgi_batch_inference_count", "Steps", method, registry=r),
        batch_inference_success=_counter(
            "tgi_batch_inference_success", "Successful steps", method, registry=r
        ),
        batch_inference_failure=_counter(
            "tgi_batch_inference_failure", "Failed steps", method, registry=r
        ),
        batch_inference_duration=duration("tgi_batch_inference_duration", "Step", method),
        batch_forward_duration=duration("tgi_batch_forward_duration", "Forward", method),
        batch_decode_duration=duration("tgi_batch_decode_duration", "Token choice", method),
        batch_filter_duration=duration("tgi_batch_filter_duration", "FilterBatch", method),
        batch_concat=_counter("tgi_batch_concat", "New batch admissions", ("reason",), registry=r),
        batch_concat_duration=duration("tgi_batch_concat_duration", "Concat", method),
        layer_skip=LayerSkipMetrics.build(r, COUNTER_NAMES),
        shard_memory=Gauge("tgi_shard_memory_bytes", "Shard memory by part: weights by kind, drafts, kv "
                           "(the KV pools), kv_used (their blocks in use), prefix_cache, resident, peak, other "
                           "(extension)", ("part",), registry=r),
    )
