"""Loading strategies: one switch from (quantize, dtype) to a loaded transformers model.

bitsandbytes is a loading strategy, not a flag inside model code: the 8-bit and 4-bit
variants quantize ordinary safetensors weights on the fly through transformers'
bitsandbytes integration (which runs on the CPU with bitsandbytes >= 0.45). bitsandbytes is
imported lazily, only when one of its modes is asked for.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from loguru import logger
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

SUPPORTED_QUANTIZE = ("bitsandbytes", "bitsandbytes-nf4", "bitsandbytes-fp4")
UPSTREAM_QUANTIZE = ("gptq", "awq", "compressed-tensors", "eetq", "exl2", "fp8", "marlin")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """The name `--dtype` and the kernels' weight kinds use for a torch dtype ("bfloat16")."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class LoadConfig:
    """How to load a model.

    Attributes:
        quantize: None, or one of SUPPORTED_QUANTIZE (upstream's names).
        dtype: compute dtype name; float32 is the CPU default.
        trust_remote_code: allow modelling code shipped with the checkpoint.
    """

    quantize: str | None = None
    dtype: str = "float32"
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        if self.quantize is not None and self.quantize not in SUPPORTED_QUANTIZE:
            where = "is an upstream TGI value that this CPU backend does not support" if (
                self.quantize in UPSTREAM_QUANTIZE) else "is not a known value"
            raise ValueError(f"--quantize {self.quantize} {where}; use one of {', '.join(SUPPORTED_QUANTIZE)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype} is not supported; use one of {', '.join(DTYPES)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def _bnb_config(load: LoadConfig) -> Any:
    from transformers import BitsAndBytesConfig

    if load.quantize == "bitsandbytes":
        return BitsAndBytesConfig(load_in_8bit=True)
    quant_type = "nf4" if load.quantize == "bitsandbytes-nf4" else "fp4"
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                              bnb_4bit_compute_dtype=load.torch_dtype)


def load_tokenizer(path: Path, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(path: Path, load: LoadConfig) -> PreTrainedModel:
    """Load a causal LM from a local checkpoint folder with the given strategy (on the CPU)."""
    kwargs: dict[str, Any] = {"dtype": load.torch_dtype, "trust_remote_code": load.trust_remote_code}
    if load.quantize is not None:
        kwargs["quantization_config"] = _bnb_config(load)
        kwargs["device_map"] = "cpu"
    # bitsandbytes warns on every int8 matmul that float32 inputs are cast to float16.
    warnings.filterwarnings("ignore", message=".*inputs will be cast from.*")
    logger.info(f"Loading {path} (dtype={load.dtype}, quantize={load.quantize})")
    model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    model.eval()
    return model
