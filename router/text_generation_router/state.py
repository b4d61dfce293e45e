"""Everything the HTTP handlers share, built once at startup."""

from __future__ import annotations

from dataclasses import dataclass

from text_generation_router.batcher import Health
from text_generation_router.client import ShardClient
from text_generation_router.config import RouterConfig, ServingLimits
from text_generation_router.env import RouterEnv
from text_generation_router.handshake import ShardInfo
from text_generation_router.infer import Infer
from text_generation_router.metrics import Metrics
from text_generation_router.tokenizer import Tokenizer


@dataclass
class AppState:
    config: RouterConfig
    limits: ServingLimits
    shard: ShardInfo
    client: ShardClient
    tokenizer: Tokenizer
    infer: Infer
    metrics: Metrics
    health: Health
    env: RouterEnv

    @property
    def model_id(self) -> str:
        return self.config.served_model_name or self.config.tokenizer_name
