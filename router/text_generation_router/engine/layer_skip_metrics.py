"""Prometheus series of the layer-skip extension (our own names, prefix `tgi_layer_skip_`).

They are fed from what the shard reports: the Info extension fields (policy state, default
mode) once at startup, and each request's LayerSkipReport (its plan on the first generation,
its drafting statistics on the last).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Gauge, Histogram

from text_generation_router.layer_skip import LayerSkipMode

from .events import LayerSkipReport

DECISION_BUCKETS = tuple(1e-5 * 2**i for i in range(20))  # 10 us .. 5 s
RATIO_BUCKETS = tuple(i / 10 for i in range(11))
LAYER_BUCKETS = tuple(float(i) for i in range(0, 65))
DRAFT_BUCKETS = tuple(float(i) for i in range(1, 9))


@dataclass
class LayerSkipMetrics:
    plans: Gauge  # counter
    layers_skipped: Histogram
    decision_duration: Histogram
    policy_loaded: Gauge
    acceptance_ratio: Histogram
    draft_length: Histogram
    drafted_tokens: Gauge  # counter
    accepted_tokens: Gauge  # counter
    auto_off: Gauge  # counter
    consistency_ratio: Gauge
    rollbacks: Gauge  # counter
    rollbacks_seen: float = 0.0  # the shard counts rollbacks; the counter follows its total

    @classmethod
    def build(cls, registry: CollectorRegistry, counter_names: list[str]) -> LayerSkipMetrics:
        """Register the series; counters are gauges listed in `counter_names` (see metrics.py)."""
        def count(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            if name not in counter_names:
                counter_names.append(name)
            return Gauge(name, doc, labels, registry=registry)

        return cls(
            plans=count("tgi_layer_skip_plans", "Layer-skip plans decided", ("mode", "rule")),
            layers_skipped=Histogram("tgi_layer_skip_layers_skipped", "Layers in a request's skip plan",
                                     registry=registry, buckets=LAYER_BUCKETS),
            decision_duration=Histogram("tgi_layer_skip_decision_duration", "Detector + decider time (s)",
                                        registry=registry, buckets=DECISION_BUCKETS),
            policy_loaded=Gauge("tgi_layer_skip_policy_loaded",
                                "1 for the shard's policy state (none, loaded, refused) and default mode",
                                ("state", "mode"), registry=registry),
            acceptance_ratio=Histogram("tgi_layer_skip_acceptance_ratio",
                                       "Verified mode: accepted / drafted tokens per request",
                                       registry=registry, buckets=RATIO_BUCKETS),
            draft_length=Histogram("tgi_layer_skip_draft_length", "Verified mode: final draft length per request",
                                   registry=registry, buckets=DRAFT_BUCKETS),
            drafted_tokens=count("tgi_layer_skip_drafted_tokens", "Verified mode: draft tokens proposed"),
            accepted_tokens=count("tgi_layer_skip_accepted_tokens", "Verified mode: draft tokens accepted"),
            auto_off=count("tgi_layer_skip_auto_off", "Verified requests that stopped drafting (too slow)"),
            consistency_ratio=Gauge("tgi_layer_skip_consistency_ratio",
                                    "Lossy mode: exact-match ratio of shadow-checked requests over the window",
                                    registry=registry),
            rollbacks=count("tgi_layer_skip_rollbacks", "Automatic rollbacks of layer skipping to off"),
        )

    def set_policy(self, state: str, mode: str) -> None:
        self.policy_loaded.labels(state=state or "none", mode=mode or LayerSkipMode.OFF.value).set(1)

    def observe_plan(self, report: LayerSkipReport) -> None:
        self.plans.labels(mode=report.mode, rule=report.rule).inc()
        self.layers_skipped.observe(len(report.skipped_layers))
        self.decision_duration.observe(report.stats.get("decision_ms", 0.0) / 1000)

    def observe_end(self, report: LayerSkipReport | None) -> int:
        """Shadow-check and drafting statistics of a finished request; returns its accepted drafts."""
        if report is not None and "shadow_consistency" in report.stats:
            self.consistency_ratio.set(report.stats["shadow_consistency"])
            total = report.stats.get("rollbacks", 0.0)
            if total > self.rollbacks_seen:
                self.rollbacks.inc(total - self.rollbacks_seen)
                self.rollbacks_seen = total
        if report is None or report.mode != LayerSkipMode.VERIFIED or "drafted" not in report.stats:
            return 0
        drafted, accepted = int(report.stats["drafted"]), int(report.stats["accepted"])
        self.drafted_tokens.inc(drafted)
        self.accepted_tokens.inc(accepted)
        if drafted:
            self.acceptance_ratio.observe(accepted / drafted)
            self.draft_length.observe(report.stats.get("draft_length", 0.0))
        if report.stats.get("auto_off"):
            self.auto_off.inc()
        return accepted
