"""Where the shard's memory goes.

`account` finds every tensor storage reachable from the runner's parts (its `memory_parts`:
weights by kind, draft copies), from the prefix cache and from the live batches' KV caches,
and counts each storage once, under the first part that reaches it (an lm_head tied to the
embeddings counts once, as embeddings). Against the process's resident memory (VmRSS) and its
peak (VmHWM), what no tensor explains is `other`: the Python runtime, torch's and the other
libraries' code and data, the allocator's slack, a tensor no part reaches.

`serving` is the cheap part reported with every step: KV, prefix cache, resident, peak.
`release_free_memory` hands glibc's freed heap pages back to the system (after the warm-up's
peak, which would otherwise stay resident).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ..models.runner.kv_cache import PoolSet
from .prefix_cache import PrefixCache

MIB = 2**20
# Not followed: values, and code (a module's globals would lead everywhere).
_LEAVES = (str, bytes, int, float, bool, complex, torch.dtype, torch.device, type, types.ModuleType,
           types.FunctionType, types.BuiltinFunctionType, types.MethodType)


def storage_bytes(root: Any, counted: set[int]) -> int:
    """Bytes of the tensor storages reachable from `root` that are not in `counted` (storage
    addresses, updated). Follows containers, object attributes and slots, the kernels'
    projections (their `tensors`) and tensors' own attributes (bitsandbytes' quant_state)."""
    total, seen, stack = 0, set(), [root]
    while stack:
        obj = stack.pop()
        if obj is None or isinstance(obj, _LEAVES) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.data_ptr() not in counted and storage.nbytes():
                counted.add(storage.data_ptr())
                total += storage.nbytes()
            stack.extend(getattr(obj, "__dict__", {}).values())
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, list | tuple | set | frozenset):
            stack.extend(obj)
        else:
            if type(obj).__name__ == "Projection":  # the kernels' weights
                stack.extend(obj.tensors)
            stack.extend(getattr(obj, "__dict__", {}).values())
            stack.extend(getattr(obj, name, None) for name in getattr(type(obj), "__slots__", ()))
    return total


def process_memory() -> dict[str, int]:
    """Resident memory now and at its peak (bytes), from /proc/self/status (zeros elsewhere)."""
    status = Path("/proc/self/status")
    found = {"resident": 0, "peak": 0}
    if status.exists():
        for line in status.read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                found["resident" if key == "VmRSS" else "peak"] = int(value.split()[0]) * 1024
    return found


def _glibc(function: str) -> Any:
    """A function of the C library, or None where there is none by that name (not glibc)."""
    name = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(name), function, None) if name else None


def release_free_memory() -> None:
    """`malloc_trim(0)`: every arena's free pages back to the system (nothing elsewhere than glibc)."""
    trim = _glibc("malloc_trim")
    if trim is not None:
        trim(0)


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
LOAD_MMAP_THRESHOLD = 256 << 10
SERVE_MMAP_THRESHOLD = 32 << 20  # glibc's own ceiling for its moving threshold (64-bit)


@contextmanager
def loading_heap() -> Iterator[None]:
    """While loading, allocations of 256 KiB and more are mapped apart and unmapped when freed:
    a load casts and quantizes thousands of transient tensors of a few MiB, and in glibc's heaps
    their freed pages stayed resident (nf4 0.5B: 1.1 GiB after loading, gone only at a trim).
    Afterwards the threshold is glibc's ceiling (allocations up to 32 MiB reuse heap memory,
    as its moving threshold would by then). Nothing elsewhere than glibc."""
    mallopt = _glibc("mallopt")
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, LOAD_MMAP_THRESHOLD)
    try:
        yield
    finally:
        if mallopt is not None:
            mallopt(M_MMAP_THRESHOLD, SERVE_MMAP_THRESHOLD)
        gc.collect()  # the loaded model's cycles
        release_free_memory()


def serving(pools: PoolSet, prefixes: PrefixCache | None) -> dict[str, int]:
    """What changes while serving: the KV pools (`kv`, their free blocks included; `kv_used`, the
    blocks in use), the prefix cache, resident memory and its peak."""
    return {"kv": pools.nbytes(), "kv_used": pools.used_bytes(),
            "prefix_cache": prefixes.nbytes if prefixes is not None else 0, **process_memory()}


def account(parts: dict[str, Any], pools: PoolSet, prefixes: PrefixCache | None) -> dict[str, int]:
    """Bytes by part: the runner's `parts` in their order, `kv` (the pools), `prefix_cache`, then
    `resident`, `peak` and `other` (resident less every tensor counted)."""
    counted: set[int] = set()
    kv = storage_bytes(pools, counted)  # first: the runner holds its pools, and parts may reach it
    found = {name: storage_bytes(part, counted) for name, part in parts.items()}
    found["kv"] = kv
    found["prefix_cache"] = storage_bytes(prefixes, counted)
    tensors = sum(found.values())
    found.update(process_memory())
    found["other"] = max(found["resident"] - tensors, 0)
    return found


def describe(found: dict[str, int]) -> str:
    """One log line: every part in MiB, in the order given."""
    return ", ".join(f"{name} {value / MIB:,.0f} MiB" for name, value in found.items())
