"""The shard's environment variables (env.py): names, defaults, precedence and refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from text_generation_server.env import HubEnv, KernelEnv, ProcessEnv, ShardEnv
from text_generation_server.watermark import WatermarkConfig


def test_hub_cache_follows_huggingface_hubs_order() -> None:
    full = {"HUGGINGFACE_HUB_CACHE": "/a", "HF_HUB_CACHE": "/b", "HF_HOME": "/c"}
    assert HubEnv.read(full).cache == Path("/a")
    assert HubEnv.read({**full, "HUGGINGFACE_HUB_CACHE": ""}).cache == Path("/b")
    assert HubEnv.read({"HF_HOME": "/c"}).cache == Path("/c/hub")
    assert HubEnv.read({}) == HubEnv(Path.home() / ".cache" / "huggingface" / "hub", None)
    assert HubEnv.read({"TGI_PREBUILT_HUB_CACHE": "/opt/models"}).prebuilt == Path("/opt/models")
    assert HubEnv.read({"TGI_PREBUILT_HUB_CACHE": ""}).prebuilt is None


def test_kernel_and_policy_variables_and_their_defaults() -> None:
    assert KernelEnv.read({}) == KernelEnv("auto", Path.home() / ".cache" / "tgi-kernels", "c++")
    assert KernelEnv.read({"TGI_CPU_KERNELS": "avx2", "TGI_KERNEL_DIR": "/k", "CXX": "g++-13"}) == (
        KernelEnv("avx2", Path("/k"), "g++-13"))
    assert KernelEnv.read({"TGI_DRAFT_WEIGHTS": "MODEL"}).draft_weights == "model"
    with pytest.raises(ValueError, match="TGI_DRAFT_WEIGHTS='fp8' is not one of int8, model"):
        KernelEnv.read({"TGI_DRAFT_WEIGHTS": "fp8"})
    assert KernelEnv.read({}).quantized_activations == "float"
    assert KernelEnv.read({"TGI_QUANTIZED_ACTIVATIONS": "INT8"}).quantized_activations == "int8"
    with pytest.raises(ValueError, match="TGI_QUANTIZED_ACTIVATIONS='int4' is not one of float, int8"):
        KernelEnv.read({"TGI_QUANTIZED_ACTIVATIONS": "int4"})
    assert ProcessEnv.read({}).policy_dir is None
    assert ProcessEnv.read({"TGI_POLICY_DIR": ""}).policy_dir is None
    assert ProcessEnv.read({"TGI_POLICY_DIR": "/p"}).policy_dir == Path("/p")


def test_shard_env_defaults_and_refusals() -> None:
    assert ShardEnv.read({}) == ShardEnv("flashdecoding-ipex", True, 0, 1, WatermarkConfig(), 256, 512)
    off = ShardEnv.read({"PREFIX_CACHING": "0", "PREFIX_CACHE_MIB": "64", "PREFILL_CHUNK_TOKENS": "0"})
    assert (off.prefix_caching, off.prefix_cache_mib, off.prefill_chunk) == (False, 64, 0)
    with pytest.raises(ValueError, match="^PREFILL_CHUNK_TOKENS=-1 is negative$"):
        ShardEnv.read({"PREFILL_CHUNK_TOKENS": "-1"})
    with pytest.raises(ValueError, match="^PREFIX_CACHE_MIB='lots' is not an integer$"):
        ShardEnv.read({"PREFIX_CACHE_MIB": "lots"})
    env = ShardEnv.read({"ATTENTION": "flashinfer", "PREFIX_CACHING": "True", "RANK": "0", "WORLD_SIZE": "1",
                         "WATERMARK_GAMMA": "0.25", "WATERMARK_DELTA": ""})
    assert (env.block_size, env.prefix_caching, env.watermark) == (1, True, WatermarkConfig(0.25, 2.0))
    with pytest.raises(ValueError, match="^ATTENTION='paged2' is not one of paged, flashdecoding"):
        ShardEnv.read({"ATTENTION": "paged2"})
    with pytest.raises(ValueError, match="^WATERMARK_DELTA='strong' is not a number$"):
        ShardEnv.read({"WATERMARK_DELTA": "strong"})
    with pytest.raises(ValueError, match="^WORLD_SIZE='two' is not an integer$"):
        ShardEnv.read({"WORLD_SIZE": "two"})
