"""Router configuration: built once from the CLI, validated here, passed to every stage."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RouterConfig:
    """Flags of `text-generation-router` (upstream names and defaults, docs/tgi-interface.md §3.2).

    Attributes:
        master_shard_uds_path: socket of shard 0 (the launcher passes `{uds}-0`).
        tokenizer_name: local folder or hub id loaded with transformers AutoTokenizer.
        served_model_name: model id reported by /info and the OpenAI routes.
        max_input_tokens / max_total_tokens: asked of Warmup; None lets the shard decide.
        max_batch_prefill_tokens: padded prompt tokens allowed in one new batch.
        max_batch_total_tokens: padded tokens allowed in flight; None = derived at warmup.
        waiting_served_ratio: queue length / running size that triggers a new prefill.
        max_waiting_tokens: decode steps after which a new prefill is forced.
        graceful_termination_timeout_s: after SIGTERM, how long in-flight requests may run.
        request_header_timeout_s: a connection's request head must arrive within this time.
    """

    master_shard_uds_path: str
    tokenizer_name: str
    served_model_name: str = ""
    hostname: str = "0.0.0.0"
    port: int = 3000
    prometheus_port: int = 9000
    max_concurrent_requests: int = 128
    max_best_of: int = 2
    max_stop_sequences: int = 4
    max_top_n_tokens: int = 5
    max_input_tokens: int | None = None
    max_total_tokens: int | None = None
    waiting_served_ratio: float = 1.2
    max_batch_prefill_tokens: int = 4096
    max_batch_total_tokens: int | None = None
    max_waiting_tokens: int = 20
    max_batch_size: int | None = None
    max_client_batch_size: int = 4
    validation_workers: int = 2
    api_key: str | None = None
    cors_allow_origin: tuple[str, ...] = field(default_factory=tuple)
    payload_limit: int = 2_000_000
    disable_grammar_support: bool = False
    json_output: bool = False
    graceful_termination_timeout_s: float = 90.0
    request_header_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        positive = {
            "--max-concurrent-requests": self.max_concurrent_requests,
            "--max-best-of": self.max_best_of,
            "--max-batch-prefill-tokens": self.max_batch_prefill_tokens,
            "--validation-workers": self.validation_workers,
            "--max-client-batch-size": self.max_client_batch_size,
            "--payload-limit": self.payload_limit,
        }
        for flag, value in positive.items():
            if value <= 0:
                raise ValueError(f"{flag} must be > 0, got {value}")
        if self.max_batch_size is not None and self.max_batch_size <= 0:
            raise ValueError(f"--max-batch-size must be > 0, got {self.max_batch_size}")
        if self.graceful_termination_timeout_s <= 0 or self.request_header_timeout_s <= 0:
            raise ValueError("--graceful-termination-timeout and --request-header-timeout must be > 0")
        if self.waiting_served_ratio < 0:
            raise ValueError("--waiting-served-ratio must be >= 0")
        if (
            self.max_input_tokens is not None
            and self.max_total_tokens is not None
            and self.max_input_tokens >= self.max_total_tokens
        ):
            raise ValueError(
                "`max_input_tokens` must be < `max_total_tokens`: lower --max-input-tokens "
                "or raise --max-total-tokens"
            )
        if not self.master_shard_uds_path:
            raise ValueError("--master-shard-uds-path must not be empty")


@dataclass(frozen=True)
class ServingLimits:
    """Token limits fixed by the warmup handshake (docs/tgi-interface.md §1.4 step 6)."""

    max_input_tokens: int
    max_total_tokens: int
    max_batch_prefill_tokens: int
    max_batch_total_tokens: int

    def __post_init__(self) -> None:
        if self.max_input_tokens >= self.max_total_tokens:
            raise ValueError(
                f"`max_input_tokens` ({self.max_input_tokens}) must be < `max_total_tokens` "
                f"({self.max_total_tokens})"
            )
        if self.max_batch_prefill_tokens > self.max_batch_total_tokens:
            raise ValueError(
                f"`max_batch_prefill_tokens` ({self.max_batch_prefill_tokens}) must be <= "
                f"`max_batch_total_tokens` ({self.max_batch_total_tokens})"
            )
        if self.max_total_tokens > self.max_batch_total_tokens:
            raise ValueError(
                f"`max_total_tokens` ({self.max_total_tokens}) must be <= "
                f"`max_batch_total_tokens` ({self.max_batch_total_tokens})"
            )
