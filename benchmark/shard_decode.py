"""Decode throughput of the gRPC shard against plain transformers `generate()`.

Same model, same threads, greedy, a fixed number of new tokens (EOS ignored), interleaved
runs (A B A B), median of 5. Decode tokens/s excludes the prefill step: (n - 1) tokens over
the time from the first to the last token. Figures: single stream, and a batch of 8
(aggregate over the 8 streams).

Usage: python benchmark/shard_decode.py [--new-tokens 128] [--threads 2] [--repeats 5] [--runner auto]
"""

from __future__ import annotations

import argparse
import time

import grpc
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer

from text_generation_server.download import DEFAULT_MODEL_ID, download_weights
from text_generation_server.pb import generate_pb2, generate_pb2_grpc

from common import interleave, start_shard, summarize, write_results

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


class FirstTokenClock(BaseStreamer):
    """Records when generate() emits its first new token (the end of prefill)."""

    def __init__(self) -> None:
        self.calls = 0
        self.first_token_at = 0.0

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2:  # the first call carries the prompt
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


def generate_tps(model: AutoModelForCausalLM, tokenizer: AutoTokenizer, new_tokens: int) -> float:
    """Single-stream generate(): the streamer marks the end of prefill."""
    inputs = tokenizer([PROMPT], return_tensors="pt")
    clock = FirstTokenClock()
    with torch.inference_mode():
        model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                       streamer=clock, pad_token_id=tokenizer.pad_token_id)
    return (new_tokens - 1) / (time.perf_counter() - clock.first_token_at)


def generate_batch_tps(model: AutoModelForCausalLM, tokenizer: AutoTokenizer, batch: int, new_tokens: int) -> float:
    """Batched generate() (streamers take one row only): prefill is timed by a 1-token run."""
    inputs = tokenizer([PROMPT] * batch, return_tensors="pt", padding=True)
    kwargs = {"do_sample": False, "pad_token_id": tokenizer.pad_token_id}
    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(**inputs, max_new_tokens=1, **kwargs)
        prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        total_s = time.perf_counter() - start
    return batch * (new_tokens - 1) / (total_s - prefill_s)


def shard_tps(stub: generate_pb2_grpc.TextGenerationServiceStub, batch: int, new_tokens: int, batch_id: int) -> float:
    requests = [generate_pb2.Request(
        id=i, inputs=PROMPT, input_chunks=generate_pb2.Input(chunks=[generate_pb2.InputChunk(text=PROMPT)]),
        parameters=generate_pb2.NextTokenChooserParameters(temperature=1.0, top_p=1.0, typical_p=1.0,
                                                           repetition_penalty=1.0),
        stopping_parameters=generate_pb2.StoppingCriteriaParameters(max_new_tokens=new_tokens, ignore_eos_token=True),
        add_special_tokens=True) for i in range(batch)]
    prefill = stub.Prefill(generate_pb2.PrefillRequest(batch=generate_pb2.Batch(
        id=batch_id, requests=requests, size=batch, max_tokens=batch * new_tokens)))
    start = time.perf_counter()
    cached = prefill.batch
    steps = 0
    while cached.size:
        response = stub.Decode(generate_pb2.DecodeRequest(batches=[cached]))
        steps += 1
        if not response.HasField("batch"):
            break
        cached = response.batch
    assert steps == new_tokens - 1, f"expected {new_tokens - 1} decode steps, ran {steps}"
    return batch * steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--runner", default="auto")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = download_weights(DEFAULT_MODEL_ID)
    tokenizer = AutoTokenizer.from_pretrained(str(path), padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    proc, socket = start_shard(DEFAULT_MODEL_ID, ["--runner", args.runner], args.threads)
    try:
        stub = generate_pb2_grpc.TextGenerationServiceStub(grpc.insecure_channel(f"unix://{socket}"))
        info = stub.Info(generate_pb2.InfoRequest())
        ids = iter(range(1, 10**6))
        figures = interleave({
            "generate_b1": lambda: generate_tps(model, tokenizer, args.new_tokens),
            "shard_b1": lambda: shard_tps(stub, 1, args.new_tokens, next(ids)),
            "generate_b8": lambda: generate_batch_tps(model, tokenizer, 8, args.new_tokens),
            "shard_b8": lambda: shard_tps(stub, 8, args.new_tokens, next(ids)),
        }, args.repeats)
    finally:
        proc.terminate()
        proc.wait()
    summary = summarize(figures)
    med = {k: v["median"] for k, v in summary.items()}
    ratios = {
        "shard_b1_over_generate_b1": med["shard_b1"] / med["generate_b1"],
        "shard_b8_over_shard_b1": med["shard_b8"] / med["shard_b1"],
        "shard_b8_over_generate_b8": med["shard_b8"] / med["generate_b8"],
    }
    print(f"\nrunner={info.runner} threads={args.threads} new_tokens={args.new_tokens} (decode tokens/s, median)")
    for name, value in med.items():
        print(f"  {name:<14} {value:8.1f}")
    for name, value in ratios.items():
        print(f"  {name:<28} {value:6.2f}x")
    write_results(f"shard_decode_{info.runner}", {"runner": info.runner, "threads": args.threads,
                                                   "new_tokens": args.new_tokens, "tokens_per_s": summary,
                                                   "ratios": ratios})


if __name__ == "__main__":
    main()
