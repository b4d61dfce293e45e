"""Engine stage: from a request's parameters to tokens: validation, queue, continuous batcher, the
protobuf dispatch, the shards' gRPC client and handshake, tokenizer, events, errors and metrics.

May import pb and the shared top-level modules (config, layer_skip); never http, launcher or cli.
"""
