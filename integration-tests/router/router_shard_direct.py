"""Drive a shard straight over gRPC with the committed stubs (no router in between)."""

from __future__ import annotations

import grpc

from text_generation_router.pb import generate_pb2 as pb
from text_generation_router.pb import generate_pb2_grpc as pb_grpc

# Far from the router's own batch ids (which count up from 0).
DIRECT_ID_BASE = 1 << 40


def greedy_request(request_id: int, prompt: str, max_new_tokens: int, truncate: int = 256) -> pb.Request:
    return pb.Request(
        id=request_id, inputs=prompt, truncate=truncate, add_special_tokens=True,
        input_chunks=pb.Input(chunks=[pb.InputChunk(text=prompt)]),
        parameters=pb.NextTokenChooserParameters(temperature=1.0, top_p=1.0, typical_p=1.0,
                                                 repetition_penalty=1.0),
        stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=max_new_tokens),
    )


def greedy_tokens(uds: str, prompt: str, max_new_tokens: int, batch_id: int = DIRECT_ID_BASE) -> list[int]:
    """Prefill then Decode until the request stops; returns the generated token ids."""
    with grpc.insecure_channel(f"unix://{uds}") as channel:
        stub = pb_grpc.TextGenerationServiceStub(channel)
        batch = pb.Batch(id=batch_id, requests=[greedy_request(batch_id, prompt, max_new_tokens)],
                         size=1, max_tokens=512)
        answer = stub.Prefill(pb.PrefillRequest(batch=batch))
        ids: list[int] = []
        while True:
            g = answer.generations[0]
            ids.extend(g.tokens.ids)
            if g.HasField("generated_text"):
                if answer.HasField("batch"):
                    stub.ClearCache(pb.ClearCacheRequest(id=answer.batch.id))
                return ids
            answer = stub.Decode(pb.DecodeRequest(batches=[answer.batch]))
