"""llama.cpp side of benchmark/runner_decode.py; runs in the benchmark-only llama.cpp venv.

It imports no torch and nothing of ours: runner_decode.py starts it as a subprocess with the
same prompt token ids, and reads one JSON line of tokens/s back. Greedy decoding through
llama.cpp's low-level batch API (argmax of the logits), EOS ignored, so every contestant
generates exactly `--new-tokens` tokens per sequence; the timed span covers the prompt and
all new tokens, as for the torch contestants.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time

import llama_cpp
import numpy as np


@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
def _quiet(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    return None


class Engine:
    """One GGUF model with a context for up to `max_seqs` sequences."""

    def __init__(self, gguf: str, threads: int, max_seqs: int, max_tokens: int) -> None:
        self.model = llama_cpp.llama_model_load_from_file(gguf.encode(), llama_cpp.llama_model_default_params())
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = max_seqs * max_tokens
        params.n_batch = params.n_ubatch = max_seqs * max_tokens
        params.n_seq_max = max_seqs
        params.n_threads = params.n_threads_batch = threads
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.batch = llama_cpp.llama_batch_init(max_seqs * max_tokens, 0, max_seqs)

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        """items: (token, position, sequence, wants logits)."""
        for i, (token, pos, seq, logits) in enumerate(items):
            self.batch.token[i] = token
            self.batch.pos[i] = pos
            self.batch.n_seq_id[i] = 1
            self.batch.seq_id[i][0] = seq
            self.batch.logits[i] = logits
        self.batch.n_tokens = len(items)
        rc = llama_cpp.llama_decode(self.ctx, self.batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax(self, index: int) -> int:
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, index), shape=(self.n_vocab,))
        return int(logits.argmax())

    def generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[int]]:
        """Greedy-generate `new_tokens` per prompt; returns aggregate tokens/s and row 0's tokens."""
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)
        start = time.perf_counter()
        items = [(t, p, s, p == len(prompt) - 1) for s, prompt in enumerate(prompts) for p, t in enumerate(prompt)]
        self._decode(items)
        last = [i for i, item in enumerate(items) if item[3]]
        tokens = [self._argmax(i) for i in last]
        positions = [len(p) for p in prompts]
        first_row = [tokens[0]]
        for _ in range(new_tokens - 1):
            self._decode([(tokens[s], positions[s], s, True) for s in range(len(prompts))])
            tokens = [self._argmax(s) for s in range(len(prompts))]
            positions = [p + 1 for p in positions]
            first_row.append(tokens[0])
        return len(prompts) * new_tokens / (time.perf_counter() - start), first_row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gguf", action="append", required=True, help="name=path, repeatable")
    parser.add_argument("--prompts", required=True, help="JSON list of token id lists; batch = its length")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    llama_cpp.llama_log_set(_quiet, ctypes.c_void_p())
    llama_cpp.llama_backend_init()
    prompts: list[list[int]] = json.loads(args.prompts)
    longest = max(len(p) for p in prompts) + args.new_tokens + 1
    result: dict[str, object] = {}
    for spec in args.gguf:
        name, path = spec.split("=", 1)
        engine = Engine(path, args.threads, len(prompts), longest)
        engine.generate(prompts, 4)  # warm-up: first-call allocations
        result[name], result[f"{name}_tokens"] = engine.generate(prompts, args.new_tokens)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
