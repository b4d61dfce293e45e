from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GrammarType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GRAMMAR_TYPE_NONE: _ClassVar[GrammarType]
    GRAMMAR_TYPE_JSON: _ClassVar[GrammarType]
    GRAMMAR_TYPE_REGEX: _ClassVar[GrammarType]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_EOS_TOKEN: _ClassVar[FinishReason]
    FINISH_REASON_STOP_SEQUENCE: _ClassVar[FinishReason]
GRAMMAR_TYPE_NONE: GrammarType
GRAMMAR_TYPE_JSON: GrammarType
GRAMMAR_TYPE_REGEX: GrammarType
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_EOS_TOKEN: FinishReason
FINISH_REASON_STOP_SEQUENCE: FinishReason

class PrepareGrammarRequest(_message.Message):
    __slots__ = ("grammar_type", "grammar")
    GRAMMAR_TYPE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    grammar_type: GrammarType
    grammar: str
    def __init__(self, grammar_type: _Optional[_Union[GrammarType, str]] = ..., grammar: _Optional[str] = ...) -> None: ...

class PrepareGrammarResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("requires_padding", "dtype", "device_type", "window_size", "speculate", "support_chunking", "use_prefix_caching", "attention_impl", "block_size", "runner", "quantize", "layer_skip_mode", "layer_skip_policy", "layer_skip_policy_state", "num_layers", "cpu_kernels")
    REQUIRES_PADDING_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TYPE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_SIZE_FIELD_NUMBER: _ClassVar[int]
    SPECULATE_FIELD_NUMBER: _ClassVar[int]
    SUPPORT_CHUNKING_FIELD_NUMBER: _ClassVar[int]
    USE_PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_IMPL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    RUNNER_FIELD_NUMBER: _ClassVar[int]
    QUANTIZE_FIELD_NUMBER: _ClassVar[int]
    LAYER_SKIP_MODE_FIELD_NUMBER: _ClassVar[int]
    LAYER_SKIP_POLICY_FIELD_NUMBER: _ClassVar[int]
    LAYER_SKIP_POLICY_STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    CPU_KERNELS_FIELD_NUMBER: _ClassVar[int]
    requires_padding: bool
    dtype: str
    device_type: str
    window_size: int
    speculate: int
    support_chunking: bool
    use_prefix_caching: bool
    attention_impl: str
    block_size: int
    runner: str
    quantize: str
    layer_skip_mode: str
    layer_skip_policy: str
    layer_skip_policy_state: str
    num_layers: int
    cpu_kernels: str
    def __init__(self, requires_padding: _Optional[bool] = ..., dtype: _Optional[str] = ..., device_type: _Optional[str] = ..., window_size: _Optional[int] = ..., speculate: _Optional[int] = ..., support_chunking: _Optional[bool] = ..., use_prefix_caching: _Optional[bool] = ..., attention_impl: _Optional[str] = ..., block_size: _Optional[int] = ..., runner: _Optional[str] = ..., quantize: _Optional[str] = ..., layer_skip_mode: _Optional[str] = ..., layer_skip_policy: _Optional[str] = ..., layer_skip_policy_state: _Optional[str] = ..., num_layers: _Optional[int] = ..., cpu_kernels: _Optional[str] = ...) -> None: ...

class ServiceDiscoveryRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServiceDiscoveryResponse(_message.Message):
    __slots__ = ("urls",)
    URLS_FIELD_NUMBER: _ClassVar[int]
    urls: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, urls: _Optional[_Iterable[str]] = ...) -> None: ...

class ClearCacheRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: int
    def __init__(self, id: _Optional[int] = ...) -> None: ...

class ClearCacheResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Image(_message.Message):
    __slots__ = ("data", "mimetype")
    DATA_FIELD_NUMBER: _ClassVar[int]
    MIMETYPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    mimetype: str
    def __init__(self, data: _Optional[bytes] = ..., mimetype: _Optional[str] = ...) -> None: ...

class InputChunk(_message.Message):
    __slots__ = ("text", "image")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    text: str
    image: Image
    def __init__(self, text: _Optional[str] = ..., image: _Optional[_Union[Image, _Mapping]] = ...) -> None: ...

class Input(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[InputChunk]
    def __init__(self, chunks: _Optional[_Iterable[_Union[InputChunk, _Mapping]]] = ...) -> None: ...

class NextTokenChooserParameters(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "typical_p", "do_sample", "seed", "repetition_penalty", "watermark", "frequency_penalty", "grammar", "grammar_type")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TYPICAL_P_FIELD_NUMBER: _ClassVar[int]
    DO_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    WATERMARK_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_TYPE_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    typical_p: float
    do_sample: bool
    seed: int
    repetition_penalty: float
    watermark: bool
    frequency_penalty: float
    grammar: str
    grammar_type: GrammarType
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., typical_p: _Optional[float] = ..., do_sample: _Optional[bool] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., watermark: _Optional[bool] = ..., frequency_penalty: _Optional[float] = ..., grammar: _Optional[str] = ..., grammar_type: _Optional[_Union[GrammarType, str]] = ...) -> None: ...

class StoppingCriteriaParameters(_message.Message):
    __slots__ = ("max_new_tokens", "stop_sequences", "ignore_eos_token")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    stop_sequences: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos_token: bool
    def __init__(self, max_new_tokens: _Optional[int] = ..., stop_sequences: _Optional[_Iterable[str]] = ..., ignore_eos_token: _Optional[bool] = ...) -> None: ...

class Request(_message.Message):
    __slots__ = ("id", "inputs", "truncate", "parameters", "stopping_parameters", "prefill_logprobs", "top_n_tokens", "input_chunks", "blocks", "slots", "adapter_id", "cache_len", "add_special_tokens", "chunk_len", "layer_skip_mode")
    ID_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    STOPPING_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_N_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INPUT_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_LEN_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_LEN_FIELD_NUMBER: _ClassVar[int]
    LAYER_SKIP_MODE_FIELD_NUMBER: _ClassVar[int]
    id: int
    inputs: str
    truncate: int
    parameters: NextTokenChooserParameters
    stopping_parameters: StoppingCriteriaParameters
    prefill_logprobs: bool
    top_n_tokens: int
    input_chunks: Input
    blocks: _containers.RepeatedScalarFieldContainer[int]
    slots: _containers.RepeatedScalarFieldContainer[int]
    adapter_id: str
    cache_len: int
    add_special_tokens: bool
    chunk_len: int
    layer_skip_mode: str
    def __init__(self, id: _Optional[int] = ..., inputs: _Optional[str] = ..., truncate: _Optional[int] = ..., parameters: _Optional[_Union[NextTokenChooserParameters, _Mapping]] = ..., stopping_parameters: _Optional[_Union[StoppingCriteriaParameters, _Mapping]] = ..., prefill_logprobs: _Optional[bool] = ..., top_n_tokens: _Optional[int] = ..., input_chunks: _Optional[_Union[Input, _Mapping]] = ..., blocks: _Optional[_Iterable[int]] = ..., slots: _Optional[_Iterable[int]] = ..., adapter_id: _Optional[str] = ..., cache_len: _Optional[int] = ..., add_special_tokens: _Optional[bool] = ..., chunk_len: _Optional[int] = ..., layer_skip_mode: _Optional[str] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("id", "requests", "size", "max_tokens", "max_blocks")
    ID_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    id: int
    requests: _containers.RepeatedCompositeFieldContainer[Request]
    size: int
    max_tokens: int
    max_blocks: int
    def __init__(self, id: _Optional[int] = ..., requests: _Optional[_Iterable[_Union[Request, _Mapping]]] = ..., size: _Optional[int] = ..., max_tokens: _Optional[int] = ..., max_blocks: _Optional[int] = ...) -> None: ...

class CachedBatch(_message.Message):
    __slots__ = ("id", "request_ids", "size", "max_tokens", "current_tokens")
    ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CURRENT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    id: int
    request_ids: _containers.RepeatedScalarFieldContainer[int]
    size: int
    max_tokens: int
    current_tokens: int
    def __init__(self, id: _Optional[int] = ..., request_ids: _Optional[_Iterable[int]] = ..., size: _Optional[int] = ..., max_tokens: _Optional[int] = ..., current_tokens: _Optional[int] = ...) -> None: ...

class GeneratedText(_message.Message):
    __slots__ = ("text", "generated_tokens", "finish_reason", "seed")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    text: str
    generated_tokens: int
    finish_reason: FinishReason
    seed: int
    def __init__(self, text: _Optional[str] = ..., generated_tokens: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., seed: _Optional[int] = ...) -> None: ...

class Tokens(_message.Message):
    __slots__ = ("ids", "logprobs", "texts", "is_special")
    IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    IS_SPECIAL_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    texts: _containers.RepeatedScalarFieldContainer[str]
    is_special: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., texts: _Optional[_Iterable[str]] = ..., is_special: _Optional[_Iterable[bool]] = ...) -> None: ...

class LayerSkipReport(_message.Message):
    __slots__ = ("mode", "skipped_layers", "rule", "max_score", "mean_score", "stats")
    class StatsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    MODE_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_LAYERS_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    MAX_SCORE_FIELD_NUMBER: _ClassVar[int]
    MEAN_SCORE_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    mode: str
    skipped_layers: _containers.RepeatedScalarFieldContainer[int]
    rule: str
    max_score: float
    mean_score: float
    stats: _containers.ScalarMap[str, float]
    def __init__(self, mode: _Optional[str] = ..., skipped_layers: _Optional[_Iterable[int]] = ..., rule: _Optional[str] = ..., max_score: _Optional[float] = ..., mean_score: _Optional[float] = ..., stats: _Optional[_Mapping[str, float]] = ...) -> None: ...

class Generation(_message.Message):
    __slots__ = ("request_id", "prefill_tokens", "tokens", "generated_text", "top_tokens", "layer_skip", "cached_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TEXT_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAYER_SKIP_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    prefill_tokens: Tokens
    tokens: Tokens
    generated_text: GeneratedText
    top_tokens: _containers.RepeatedCompositeFieldContainer[Tokens]
    layer_skip: LayerSkipReport
    cached_tokens: int
    def __init__(self, request_id: _Optional[int] = ..., prefill_tokens: _Optional[_Union[Tokens, _Mapping]] = ..., tokens: _Optional[_Union[Tokens, _Mapping]] = ..., generated_text: _Optional[_Union[GeneratedText, _Mapping]] = ..., top_tokens: _Optional[_Iterable[_Union[Tokens, _Mapping]]] = ..., layer_skip: _Optional[_Union[LayerSkipReport, _Mapping]] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class FilterBatchRequest(_message.Message):
    __slots__ = ("batch_id", "request_ids")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    request_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, batch_id: _Optional[int] = ..., request_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class FilterBatchResponse(_message.Message):
    __slots__ = ("batch",)
    BATCH_FIELD_NUMBER: _ClassVar[int]
    batch: CachedBatch
    def __init__(self, batch: _Optional[_Union[CachedBatch, _Mapping]] = ...) -> None: ...

class RequestError(_message.Message):
    __slots__ = ("request_id", "message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    message: str
    def __init__(self, request_id: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("batch", "cached_batch", "per_request_errors")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    CACHED_BATCH_FIELD_NUMBER: _ClassVar[int]
    PER_REQUEST_ERRORS_FIELD_NUMBER: _ClassVar[int]
    batch: Batch
    cached_batch: CachedBatch
    per_request_errors: bool
    def __init__(self, batch: _Optional[_Union[Batch, _Mapping]] = ..., cached_batch: _Optional[_Union[CachedBatch, _Mapping]] = ..., per_request_errors: _Optional[bool] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("generations", "batch", "forward_ns", "decode_ns", "total_ns", "concat_ns", "request_errors", "memory_bytes")
    class MemoryBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    DECODE_NS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NS_FIELD_NUMBER: _ClassVar[int]
    CONCAT_NS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ERRORS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    generations: _containers.RepeatedCompositeFieldContainer[Generation]
    batch: CachedBatch
    forward_ns: int
    decode_ns: int
    total_ns: int
    concat_ns: int
    request_errors: _containers.RepeatedCompositeFieldContainer[RequestError]
    memory_bytes: _containers.ScalarMap[str, int]
    def __init__(self, generations: _Optional[_Iterable[_Union[Generation, _Mapping]]] = ..., batch: _Optional[_Union[CachedBatch, _Mapping]] = ..., forward_ns: _Optional[int] = ..., decode_ns: _Optional[int] = ..., total_ns: _Optional[int] = ..., concat_ns: _Optional[int] = ..., request_errors: _Optional[_Iterable[_Union[RequestError, _Mapping]]] = ..., memory_bytes: _Optional[_Mapping[str, int]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("batches", "per_request_errors")
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    PER_REQUEST_ERRORS_FIELD_NUMBER: _ClassVar[int]
    batches: _containers.RepeatedCompositeFieldContainer[CachedBatch]
    per_request_errors: bool
    def __init__(self, batches: _Optional[_Iterable[_Union[CachedBatch, _Mapping]]] = ..., per_request_errors: _Optional[bool] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("generations", "batch", "forward_ns", "decode_ns", "total_ns", "concat_ns", "request_errors", "memory_bytes")
    class MemoryBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    DECODE_NS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NS_FIELD_NUMBER: _ClassVar[int]
    CONCAT_NS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ERRORS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    generations: _containers.RepeatedCompositeFieldContainer[Generation]
    batch: CachedBatch
    forward_ns: int
    decode_ns: int
    total_ns: int
    concat_ns: int
    request_errors: _containers.RepeatedCompositeFieldContainer[RequestError]
    memory_bytes: _containers.ScalarMap[str, int]
    def __init__(self, generations: _Optional[_Iterable[_Union[Generation, _Mapping]]] = ..., batch: _Optional[_Union[CachedBatch, _Mapping]] = ..., forward_ns: _Optional[int] = ..., decode_ns: _Optional[int] = ..., total_ns: _Optional[int] = ..., concat_ns: _Optional[int] = ..., request_errors: _Optional[_Iterable[_Union[RequestError, _Mapping]]] = ..., memory_bytes: _Optional[_Mapping[str, int]] = ...) -> None: ...

class WarmupRequest(_message.Message):
    __slots__ = ("batch", "max_input_tokens", "max_prefill_tokens", "max_total_tokens")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    batch: Batch
    max_input_tokens: int
    max_prefill_tokens: int
    max_total_tokens: int
    def __init__(self, batch: _Optional[_Union[Batch, _Mapping]] = ..., max_input_tokens: _Optional[int] = ..., max_prefill_tokens: _Optional[int] = ..., max_total_tokens: _Optional[int] = ...) -> None: ...

class WarmupResponse(_message.Message):
    __slots__ = ("max_supported_total_tokens", "max_input_tokens", "max_total_tokens", "memory_bytes")
    class MemoryBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    MAX_SUPPORTED_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    max_supported_total_tokens: int
    max_input_tokens: int
    max_total_tokens: int
    memory_bytes: _containers.ScalarMap[str, int]
    def __init__(self, max_supported_total_tokens: _Optional[int] = ..., max_input_tokens: _Optional[int] = ..., max_total_tokens: _Optional[int] = ..., memory_bytes: _Optional[_Mapping[str, int]] = ...) -> None: ...
