"""Drives a shard as upstream v3's router does with prefix caching and chunking on, through gRPC
stubs generated from the upstream wire contract (test_upstream_v3_shard.py makes them: our proto
less every extension). Run in a process of its own, as those stubs define the same protobuf
package as ours:

    python upstream_v3_driver.py <stubs folder> <shard socket> <model folder>

Prints one JSON object: the Info answer, each request's token ids, and the hex of the
responses that carried a first token (the test reads our extension fields from them).
Blocks, slots and cache_len come from the router's own BlockAllocator, as upstream's queue
sends them.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Any

SYSTEM = ("You are a careful assistant for a small bakery. Answer in one short sentence, name the "
          "product, and never invent prices. The bakery sells sourdough loaves, rye bread, croissants, "
          "cinnamon rolls, baguettes and seasonal fruit tarts; it opens at seven and closes at six. ") * 3
NOTES = ("Delivery notes: orders over twenty loaves go out on Tuesdays and Fridays by van; the driver "
         "calls ahead, and anything left unsold by six is given to the shelter on Mill Street. ") * 3


@dataclass
class Run:
    """The requests in flight, as the router's entries: tokens so far and the allocation."""

    tokens: dict[int, list[int]] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)
    first: dict[int, str] = field(default_factory=dict)  # hex of the response with a request's first token

    def collect(self, response: Any) -> None:
        for g in response.generations:
            if g.request_id not in self.tokens:
                self.tokens[g.request_id] = []
                self.first[g.request_id] = response.SerializeToString().hex()
            self.tokens[g.request_id].extend(g.tokens.ids)
            if g.HasField("generated_text"):
                self.done.add(g.request_id)


def main(stubs: str, socket: str, model: str) -> None:
    sys.path.insert(0, stubs)
    import generate_pb2 as pb  # noqa: PLC0415 - the stubs of the folder given
    import generate_pb2_grpc as rpc  # noqa: PLC0415
    import grpc  # noqa: PLC0415
    from transformers import AutoTokenizer  # noqa: PLC0415

    from text_generation_router.engine.block_allocator import Allocation, BlockAllocator  # noqa: PLC0415

    stub = rpc.TextGenerationServiceStub(grpc.insecure_channel(f"unix://{socket}"))
    tokenizer = AutoTokenizer.from_pretrained(model)
    stub.ClearCache(pb.ClearCacheRequest())
    info = stub.Info(pb.InfoRequest())
    warm = pb.Request(id=0, inputs="_test " * 64, truncate=64, input_chunks=pb.Input(chunks=[pb.InputChunk(
        text="_test " * 64)]), parameters=pb.NextTokenChooserParameters(temperature=1.0, top_p=1.0, typical_p=1.0,
                                                                         repetition_penalty=1.0),
        stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=2, ignore_eos_token=True),
        add_special_tokens=True)
    stub.Warmup(pb.WarmupRequest(batch=pb.Batch(id=0, requests=[warm], size=1, max_tokens=64),
                                 max_input_tokens=1000, max_prefill_tokens=1024, max_total_tokens=1024))
    blocks = BlockAllocator(4096 // info.block_size, info.block_size, info.use_prefix_caching)
    held: dict[int, Allocation] = {}
    sent: dict[str, int] = {}  # cache_len sent, by request id
    run = Run()

    def request(rid: int, text: str, new: int = 12, chunk_len: int | None = None, logprobs: bool = False) -> Any:
        ids = tokenizer(text)["input_ids"]
        allocation = blocks.allocate(len(ids) + new - 1 + info.speculate, None if logprobs else ids)
        assert allocation is not None
        held[rid], sent[str(rid)] = allocation, allocation.prefix_len
        r = pb.Request(id=rid, inputs=text, input_chunks=pb.Input(chunks=[pb.InputChunk(text=text)]),
                       parameters=pb.NextTokenChooserParameters(temperature=1.0, top_p=1.0, typical_p=1.0,
                                                                repetition_penalty=1.0),
                       stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=new, ignore_eos_token=True),
                       prefill_logprobs=logprobs, add_special_tokens=True, blocks=allocation.blocks,
                       slots=allocation.slots, cache_len=allocation.prefix_len)
        if chunk_len is not None:
            r.chunk_len = chunk_len
        return r

    def finish(cached: Any) -> Any:
        """Decode until every request in flight has ended; their blocks go back, prompts published."""
        while cached is not None and cached.size:
            out = stub.Decode(pb.DecodeRequest(batches=[cached]))
            run.collect(out)
            cached = out.batch if out.HasField("batch") else None
            live = [i for i in cached.request_ids if i not in run.done] if cached is not None else []
            if cached is not None and len(live) != cached.size:
                if live:
                    cached = stub.FilterBatch(pb.FilterBatchRequest(batch_id=cached.id, request_ids=live)).batch
                else:
                    stub.ClearCache(pb.ClearCacheRequest(id=cached.id))
                    cached = None
        for rid in list(held):
            blocks.free_allocation(held.pop(rid), prefilled=rid in run.tokens)

    question_a, question_b = SYSTEM + "Question: what opens at seven?", NOTES + "Question: when does the van go?"
    # A alone; once it decodes, B joins it in a Prefill with cached_batch and a small first chunk
    out = stub.Prefill(pb.PrefillRequest(batch=pb.Batch(id=1, requests=[request(1, question_a)], size=1)))
    run.collect(out)
    cached = out.batch
    while len(run.tokens.get(1, [])) < 2:
        out = stub.Decode(pb.DecodeRequest(batches=[cached]))
        run.collect(out)
        cached = out.batch
    before = len(run.tokens[1])
    joined = stub.Prefill(pb.PrefillRequest(batch=pb.Batch(id=2, requests=[request(2, question_b, chunk_len=40)],
                                                           size=1), cached_batch=cached))
    run.collect(joined)
    report = {"joined": {"id": joined.batch.id, "request_ids": list(joined.batch.request_ids),
                         "a_stepped": len(run.tokens[1]) - before, "b_first": 2 in run.tokens,
                         "current_tokens": joined.batch.current_tokens, "concat": joined.HasField("concat_ns"),
                         "b_prompt": len(tokenizer(question_b)["input_ids"])}}
    finish(joined.batch)
    # A's prompt again (cached whole), and a prompt that leaves the system prompt inside a block,
    # each with its reference: the same prompt asking for its prompt's logprobs runs it whole
    diverging = SYSTEM[: len(SYSTEM) // 2 + 7] + " Which of these is sweet?"
    for batch_id, (rid, text, logprobs) in enumerate([(3, question_a, False), (4, diverging, False),
                                                      (5, diverging, True), (6, question_b, True)], start=3):
        batch = pb.Batch(id=batch_id, requests=[request(rid, text, logprobs=logprobs)], size=1)
        out = stub.Prefill(pb.PrefillRequest(batch=batch))
        run.collect(out)
        finish(out.batch if out.HasField("batch") else None)
    report.update(info={"requires_padding": info.requires_padding, "support_chunking": info.support_chunking,
                        "use_prefix_caching": info.use_prefix_caching, "block_size": info.block_size,
                        "attention_impl": info.attention_impl},
                  tokens={str(k): v for k, v in run.tokens.items()}, first={str(k): v for k, v in run.first.items()},
                  cache_len=sent, blocks={"used": blocks.used, "cached": blocks.cached})
    print(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:4])
