"""Loading strategies: one switch from (quantize, dtype) to a loaded transformers model.

bitsandbytes is a loading strategy, not a flag inside model code: the 8-bit and 4-bit
variants quantize ordinary safetensors weights on the fly through transformers'
bitsandbytes integration (which runs on the CPU with bitsandbytes >= 0.45). bitsandbytes is
imported lazily, only when one of its modes is asked for.

Design note: transformers memory-maps a safetensors checkpoint, and every page it reads counts
in the process's resident memory until loading ends: loading a float32 checkpoint as bfloat16
peaked at the whole file plus the loaded model. Here each tensor is read with pread instead
(nothing of the file is mapped), and a floating-point tensor to be cast is cast a block of rows
at a time into its final buffer (`_CastRows`), so the float32 source of a large tensor (an
embedding table) never exists whole. The loaded weights are bitwise those of transformers' own
path (tests/server/test_loading.py).

An untied model's input embeddings are a table of which a step reads a few rows: each lookup
reads its rows from the checkpoint file (`MappedEmbedding`: one pread per distinct id, served
from the page cache once read, cast to the served dtype: the same values as the loaded table's)
instead of holding the whole table (260 MiB for Qwen2.5 0.5B in bfloat16). A memory map was
measured first: the kernel maps 64 KiB around each faulting row, so 2,000 distinct tokens made
112 MiB of a float32 table resident, growing toward all of it.
"""

from __future__ import annotations

import json
import os
import warnings
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
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


CAST_BLOCK_BYTES = 16 << 20  # source bytes cast at a time
_FLOAT_CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}


class _CastRows:
    """A checkpoint tensor as transformers' loader reads it (`tensor[...]`), read with pread and
    cast to `dtype` CAST_BLOCK_BYTES of source rows at a time."""

    def __init__(self, source: Any, dtype: torch.dtype) -> None:
        self.source, self.dtype = source, dtype  # a safetensors slice (pread)

    def get_shape(self) -> list[int]:
        return list(self.source.get_shape())

    def __getitem__(self, index: Any) -> torch.Tensor:
        assert index is Ellipsis, f"a checkpoint tensor is read whole, not [{index}]"
        shape = self.get_shape()
        if len(shape) < 2:
            return self.source[...].to(self.dtype)
        out = torch.empty(shape, dtype=self.dtype)
        step = max(1, CAST_BLOCK_BYTES // (out[0].numel() * 8))
        for start in range(0, shape[0], step):
            end = min(start + step, shape[0])
            out[start:end] = self.source[start:end]
        return out


def _pread_state(path: Path, model_class: Any, dtype: torch.dtype, stack: ExitStack) -> dict[str, Any] | None:
    """The checkpoint's tensors as pread slices (floating ones cast to `dtype` row blocks at a
    time); None where transformers' own path must read it (no safetensors, modules kept in
    float32 whatever the dtype)."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files or getattr(model_class, "_keep_in_fp32_modules", None) or getattr(
            model_class, "_keep_in_fp32_modules_strict", None):
        return None
    state: dict[str, Any] = {}
    for file in files:
        handle = stack.enter_context(safe_open(str(file), framework="pt", device="cpu", backend="pread"))
        for name in handle.keys():  # noqa: SIM118 (a safetensors handle is not iterable)
            source = handle.get_slice(name)
            cast = source.get_dtype() in _FLOAT_CODES and source.get_dtype() != _FLOAT_CODES.get(dtype)
            state[name] = _CastRows(source, dtype) if cast else source
    return state


def load_model(path: Path, load: LoadConfig) -> PreTrainedModel:
    """Load a causal LM from a local checkpoint folder with the given strategy (on the CPU)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    kwargs: dict[str, Any] = {"dtype": load.torch_dtype, "trust_remote_code": load.trust_remote_code}
    if load.quantize is not None:
        kwargs["quantization_config"] = _bnb_config(load)
        kwargs["device_map"] = "cpu"
    # bitsandbytes warns on every int8 matmul that float32 inputs are cast to float16.
    warnings.filterwarnings("ignore", message=".*inputs will be cast from.*")
    logger.info(f"Loading {path} (dtype={load.dtype}, quantize={load.quantize})")
    config = AutoConfig.from_pretrained(str(path), trust_remote_code=load.trust_remote_code)
    model_class: Any = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    with ExitStack() as stack:
        state = _pread_state(path, model_class, load.torch_dtype, stack) if model_class is not None else None
        if state is None:
            model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
        else:
            model = model_class.from_pretrained(None, config=config, state_dict=state, **kwargs)
    model.eval()
    return model


class MappedEmbedding(torch.nn.Module):
    """Input embeddings read from the checkpoint file per lookup: each distinct id's row with one
    pread (from the page cache once read), cast to `dtype`. Holds no table: `shape` is its size."""

    def __init__(self, file: Path, offset: int, shape: tuple[int, int], source: torch.dtype,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.fd = os.open(file, os.O_RDONLY)
        self.offset, self.shape, self.source, self.dtype = offset, torch.Size(shape), source, dtype
        self.row_bytes = shape[1] * torch.empty((), dtype=source).element_size()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids, where = torch.unique(input_ids, return_inverse=True)
        if int(ids.min()) < 0 or int(ids.max()) >= self.shape[0]:
            raise IndexError(f"token ids {ids.min()}..{ids.max()} outside the embedding table of {self.shape[0]}")
        rows = bytearray(len(ids) * self.row_bytes)
        for n, token in enumerate(ids.tolist()):
            rows[n * self.row_bytes:(n + 1) * self.row_bytes] = os.pread(
                self.fd, self.row_bytes, self.offset + token * self.row_bytes)
        table = torch.frombuffer(rows, dtype=self.source).view(len(ids), self.shape[1]).to(self.dtype)
        return F.embedding(where, table)

    def __del__(self) -> None:
        os.close(self.fd)


_SOURCE_DTYPES = {code: dtype for dtype, code in _FLOAT_CODES.items()}


def mapped_embeddings(model: PreTrainedModel, path: Path) -> MappedEmbedding | None:
    """The model's input embeddings read from its checkpoint table per lookup, or None
    where that cannot serve: tied to the lm_head (every row is read each step anyway), not found
    in a safetensors file as a floating table, or a sample of rows differing from the loaded
    ones (a checkpoint transformed while loading)."""
    loaded: Any = model.get_input_embeddings()
    output: Any = model.get_output_embeddings()
    if output is not None and output.weight.data_ptr() == loaded.weight.data_ptr():
        return None
    name = next((n for n, m in model.named_modules() if m is loaded), None)
    for file in sorted(path.glob("*.safetensors")) if name is not None else ():
        with open(file, "rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            entry = json.loads(handle.read(size)).get(f"{name}.weight")
        if entry is None:
            continue
        if entry["dtype"] not in _SOURCE_DTYPES or tuple(entry["shape"]) != tuple(loaded.weight.shape):
            return None
        table = MappedEmbedding(file, 8 + size + entry["data_offsets"][0], tuple(entry["shape"]),
                                _SOURCE_DTYPES[entry["dtype"]], loaded.weight.dtype)
        rows = torch.tensor([[0, table.shape[0] // 2, table.shape[0] - 1]])
        return table if torch.equal(table(rows), loaded(rows)) else None
    return None
