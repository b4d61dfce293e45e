"""Loading strategies: one switch from (quantize, dtype) to a loaded transformers model.

bitsandbytes is a loading strategy, not a flag inside model code: the 8-bit and 4-bit
variants quantize ordinary safetensors weights on the fly through transformers'
bitsandbytes integration (which runs on the CPU with bitsandbytes >= 0.45). bitsandbytes is
imported lazily, only when one of its modes is asked for.

Design note: transformers memory-maps a safetensors checkpoint, and every page it reads counts
in the process's resident memory until loading ends: loading a float32 checkpoint as bfloat16
peaked at the whole file plus the loaded model. Here each tensor is read with pread into its
final buffer (`CheckpointTensor`; nothing of the file is mapped), and a floating-point tensor to
be cast is read and cast a block of rows at a time, so the float32 source of a large tensor (an
embedding table) never exists whole. (safetensors' own pread backend reads a whole tensor for
every slice asked of it.) The loaded weights are bitwise those of transformers' own path
(tests/server/test_loading.py).

The server loads an untied model's input embeddings and lm_head as placeholders that hold no
memory (`load_model(defer_tables=True)`), and whoever serves them reads them from the file: the
fast runner looks input ids up in the checkpoint per request (`MappedEmbedding`: one pread per
distinct id, served from the page cache once read, cast to the served dtype) instead of holding
the table (260 MiB for Qwen2.5 0.5B in bfloat16), and quantizes a quantized model's int8 head
from row blocks (bitsandbytes keeps the head dense: 260 MiB more while loading); the
transformers runner reads both whole (`read_deferred_tables`). A memory map was measured for the
lookups first: the kernel maps 64 KiB around each faulting row, so 2,000 distinct tokens made
112 MiB of a float32 table resident, growing toward all of it.
"""

from __future__ import annotations

import ctypes
import json
import os
import warnings
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
_SOURCE_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                  "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                  "BOOL": torch.bool}  # safetensors' dtype codes


class _File:
    """A file open for pread, closed with the last tensor that reads it."""

    def __init__(self, path: Path) -> None:
        self.path, self.fd = path, os.open(path, os.O_RDONLY)

    def read_into(self, out: torch.Tensor, offset: int) -> None:
        """Fill the contiguous tensor `out` with the file's bytes from `offset`."""
        assert out.is_contiguous()
        size = out.numel() * out.element_size()
        if size == 0:
            return
        view = memoryview((ctypes.c_char * size).from_address(out.data_ptr())).cast("B")
        done = 0
        while done < size:
            count = os.preadv(self.fd, [view[done:]], offset + done)
            if count == 0:
                raise EOFError(f"{self.path}: ends before byte {offset + size}")
            done += count

    def __del__(self) -> None:
        os.close(self.fd)


class CheckpointTensor:
    """One tensor of a safetensors file, read with pread into its final buffer (nothing of the
    file is mapped). `tensor[...]` (what transformers' loader asks) reads it whole as `dtype`,
    `tensor[start:stop]` a block of rows; a floating tensor stored in another dtype is read and
    cast CAST_BLOCK_BYTES of source rows at a time."""

    def __init__(self, file: _File, offset: int, shape: tuple[int, ...], source: torch.dtype,
                 dtype: torch.dtype) -> None:
        self.file, self.offset, self.shape, self.source = file, offset, torch.Size(shape), source
        self.dtype = dtype if source.is_floating_point else source
        self.row_bytes = self.shape[1:].numel() * source.itemsize

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def rows(self, start: int, stop: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows start..stop (of the first dimension) as `dtype` (default: the loaded dtype)."""
        dtype = dtype or self.dtype
        out = torch.empty((stop - start, *self.shape[1:]), dtype=dtype)
        if dtype == self.source:
            self.file.read_into(out, self.offset + start * self.row_bytes)
            return out
        step = max(1, CAST_BLOCK_BYTES // max(1, self.row_bytes))
        block = torch.empty((min(step, stop - start), *self.shape[1:]), dtype=self.source)
        for first in range(start, stop, step):
            part = block[:min(step, stop - first)]
            self.file.read_into(part, self.offset + first * self.row_bytes)
            out[first - start:first - start + len(part)] = part
        return out

    def read(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        if not self.shape:
            return self.rows(0, 1, dtype).view(())
        return self.rows(0, self.shape[0], dtype)

    def __getitem__(self, index: Any) -> torch.Tensor:
        if index is Ellipsis:
            return self.read()
        assert isinstance(index, slice) and index.step is None, f"a checkpoint tensor is read by rows, not [{index}]"
        start, stop, _ = index.indices(self.shape[0])
        return self.rows(start, stop)


def checkpoint_tensors(path: Path, dtype: torch.dtype) -> dict[str, CheckpointTensor] | None:
    """Every tensor of the folder's safetensors files, floating ones to be read as `dtype`; None
    where there are none, or one is stored in a dtype read here does not know."""
    state: dict[str, CheckpointTensor] = {}
    files = sorted(path.glob("*.safetensors"))
    for name in files:
        with open(name, "rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(size))
        file = _File(name)
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            if entry["dtype"] not in _SOURCE_DTYPES:
                return None
            state[key] = CheckpointTensor(file, 8 + size + entry["data_offsets"][0], tuple(entry["shape"]),
                                          _SOURCE_DTYPES[entry["dtype"]], dtype)
    return state or None


class _Deferred:
    """A table loaded as a placeholder that holds no memory (one element, broadcast), read from
    the checkpoint by whoever serves it (see `deferred_table`)."""

    def __init__(self, source: CheckpointTensor, placeholders: dict[int, CheckpointTensor]) -> None:
        self.source, self.placeholders = source, placeholders

    def get_shape(self) -> list[int]:
        return self.source.get_shape()

    def __getitem__(self, index: Any) -> torch.Tensor:
        assert index is Ellipsis, f"a deferred table is read whole, not [{index}]"
        placeholder = torch.zeros(1, dtype=self.source.dtype).expand(self.source.shape)
        self.placeholders[placeholder.data_ptr()] = self.source
        return placeholder


def deferred_table(model: Any, weight: torch.Tensor) -> CheckpointTensor | None:
    """Where `weight` of a model loaded with `load_model(defer_tables=True)` is still to be read
    from, or None where it holds its values."""
    return getattr(model, "_deferred_tables", {}).get(weight.data_ptr())


def read_deferred_tables(model: Any) -> None:
    """Read every deferred table of `model` into its parameter (for a runner that executes the
    model's own modules)."""
    for param in model.parameters():
        source = deferred_table(model, param)
        if source is not None:
            param.data = source.read(param.dtype)
    model._deferred_tables = {}


def _vocab_tables(config: Any, state: dict[str, CheckpointTensor]) -> list[str]:
    """An untied model's input embeddings and lm_head: its [vocab, hidden] floating tensors."""
    text = config.get_text_config()
    if getattr(text, "tie_word_embeddings", True):
        return []
    shape = torch.Size([int(text.vocab_size), int(text.hidden_size)])
    return [name for name, tensor in state.items() if tensor.shape == shape and tensor.source.is_floating_point]


def load_model(path: Path, load: LoadConfig, defer_tables: bool = False) -> PreTrainedModel:
    """Load a causal LM from a local checkpoint folder with the given strategy (on the CPU).

    With `defer_tables`, an untied model's input embeddings and lm_head ([vocab, hidden], 260 MiB
    each for Qwen2.5 0.5B in bfloat16) are loaded as placeholders holding no memory, and their
    server reads them from the checkpoint (`deferred_table`, `read_deferred_tables`): transformers'
    loader would build both whole, and bitsandbytes keeps the head dense beside the runner's copy.
    """
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
    # Modules kept in float32 whatever the dtype are read by transformers' own path.
    own_path = model_class is None or getattr(model_class, "_keep_in_fp32_modules", None) or getattr(
        model_class, "_keep_in_fp32_modules_strict", None)
    state: dict[str, Any] | None = None if own_path else checkpoint_tensors(path, load.torch_dtype)
    if state is None:
        model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
        model.eval()
        return model
    placeholders: dict[int, CheckpointTensor] = {}
    for name in _vocab_tables(config, state) if defer_tables else ():
        state[name] = _Deferred(state[name], placeholders)
    model = model_class.from_pretrained(None, config=config, state_dict=state, **kwargs)
    kept = {p.data_ptr() for p in model.parameters()}
    if any(address not in kept for address in placeholders):  # transformed while loading: read them
        logger.warning(f"{path}: a vocabulary table was transformed while loading; loading it whole")
        return load_model(path, load)
    model._deferred_tables = placeholders
    model.eval()
    return model


class MappedEmbedding(torch.nn.Module):
    """Input embeddings read from the checkpoint file per lookup: each distinct id's row with one
    pread (from the page cache once read), cast to `dtype`. Holds no table: `shape` is its size."""

    def __init__(self, table: CheckpointTensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.table, self.shape, self.source, self.dtype = table, table.shape, table.source, dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids, where = torch.unique(input_ids, return_inverse=True)
        if int(ids.min()) < 0 or int(ids.max()) >= self.shape[0]:
            raise IndexError(f"token ids {ids.min()}..{ids.max()} outside the embedding table of {self.shape[0]}")
        rows = torch.empty((len(ids), self.shape[1]), dtype=self.source)
        for n, token in enumerate(ids.tolist()):
            self.table.file.read_into(rows[n], self.table.offset + token * self.table.row_bytes)
        return F.embedding(where, rows.to(self.dtype))
