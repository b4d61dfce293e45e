"""Everything the HTTP handlers share, built once at startup."""

from __future__ import annotations

from dataclasses import dataclass

from text_generation_router.config import RouterConfig, ServingLimits
from text_generation_router.engine.batcher import Health
from text_generation_router.engine.client import ShardClient
from text_generation_router.engine.handshake import ShardInfo
from text_generation_router.engine.infer import Infer
from text_generation_router.engine.metrics import Metrics
from text_generation_router.engine.tokenizer import Tokenizer
from text_generation_router.env import RouterEnv


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
