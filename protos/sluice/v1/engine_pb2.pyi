from protos.sluice.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InspectAdapterRequest(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "adapter", "priority", "adapter_spec", "hold_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_SPEC_FIELD_NUMBER: _ClassVar[int]
    HOLD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    adapter: str
    priority: int
    adapter_spec: _common_pb2.AdapterSpec
    hold_tokens: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., adapter: _Optional[str] = ..., priority: _Optional[int] = ..., adapter_spec: _Optional[_Union[_common_pb2.AdapterSpec, _Mapping]] = ..., hold_tokens: bool = ...) -> None: ...

class StreamPacing(_message.Message):
    __slots__ = ("tokens_per_update", "max_hold_ms")
    TOKENS_PER_UPDATE_FIELD_NUMBER: _ClassVar[int]
    MAX_HOLD_MS_FIELD_NUMBER: _ClassVar[int]
    tokens_per_update: int
    max_hold_ms: int
    def __init__(self, tokens_per_update: _Optional[int] = ..., max_hold_ms: _Optional[int] = ...) -> None: ...

class EngineRequest(_message.Message):
    __slots__ = ("submits", "aborts", "pacing")
    SUBMITS_FIELD_NUMBER: _ClassVar[int]
    ABORTS_FIELD_NUMBER: _ClassVar[int]
    PACING_FIELD_NUMBER: _ClassVar[int]
    submits: _containers.RepeatedCompositeFieldContainer[SubmitRequest]
    aborts: _containers.RepeatedScalarFieldContainer[str]
    pacing: StreamPacing
    def __init__(self, submits: _Optional[_Iterable[_Union[SubmitRequest, _Mapping]]] = ..., aborts: _Optional[_Iterable[str]] = ..., pacing: _Optional[_Union[StreamPacing, _Mapping]] = ...) -> None: ...

class EngineLoad(_message.Message):
    __slots__ = ("free_blocks", "total_blocks", "running", "waiting", "resident_adapters", "lora_slots", "loading_adapters", "queued_prompt_tokens", "prefill_tokens_per_s", "decode_tokens_per_s", "finished_per_s", "lora_adapter_capacity", "finish_steps", "finish_steps_of", "stop_hazard")
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    LORA_SLOTS_FIELD_NUMBER: _ClassVar[int]
    LOADING_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    FINISHED_PER_S_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTER_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    FINISH_STEPS_FIELD_NUMBER: _ClassVar[int]
    FINISH_STEPS_OF_FIELD_NUMBER: _ClassVar[int]
    STOP_HAZARD_FIELD_NUMBER: _ClassVar[int]
    free_blocks: int
    total_blocks: int
    running: int
    waiting: int
    resident_adapters: _containers.RepeatedScalarFieldContainer[str]
    lora_slots: int
    loading_adapters: _containers.RepeatedScalarFieldContainer[str]
    queued_prompt_tokens: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    finished_per_s: float
    lora_adapter_capacity: int
    finish_steps: _containers.RepeatedScalarFieldContainer[int]
    finish_steps_of: int
    stop_hazard: float
    def __init__(self, free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., resident_adapters: _Optional[_Iterable[str]] = ..., lora_slots: _Optional[int] = ..., loading_adapters: _Optional[_Iterable[str]] = ..., queued_prompt_tokens: _Optional[int] = ..., prefill_tokens_per_s: _Optional[float] = ..., decode_tokens_per_s: _Optional[float] = ..., finished_per_s: _Optional[float] = ..., lora_adapter_capacity: _Optional[int] = ..., finish_steps: _Optional[_Iterable[int]] = ..., finish_steps_of: _Optional[int] = ..., stop_hazard: _Optional[float] = ...) -> None: ...

class SequenceUpdate(_message.Message):
    __slots__ = ("request_id", "token_ids", "logprobs", "finish_reason", "error", "usage")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    finish_reason: _common_pb2.FinishReason
    error: _common_pb2.ItemError
    usage: _common_pb2.Usage
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., error: _Optional[_Union[_common_pb2.ItemError, _Mapping]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ...) -> None: ...

class EngineStep(_message.Message):
    __slots__ = ("updates", "load", "step_index", "step_time_ms", "num_batched_tokens", "submits_taken")
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    STEP_INDEX_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SUBMITS_TAKEN_FIELD_NUMBER: _ClassVar[int]
    updates: _containers.RepeatedCompositeFieldContainer[SequenceUpdate]
    load: EngineLoad
    step_index: int
    step_time_ms: float
    num_batched_tokens: int
    submits_taken: int
    def __init__(self, updates: _Optional[_Iterable[_Union[SequenceUpdate, _Mapping]]] = ..., load: _Optional[_Union[EngineLoad, _Mapping]] = ..., step_index: _Optional[int] = ..., step_time_ms: _Optional[float] = ..., num_batched_tokens: _Optional[int] = ..., submits_taken: _Optional[int] = ...) -> None: ...

class EngineInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineInfo(_message.Message):
    __slots__ = ("model", "max_model_len", "vocab_size", "block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens", "eos_token_ids", "engine_id", "backend", "device", "dtype", "load", "max_loras", "max_lora_rank", "execution_path", "target_step_ms", "max_inflight")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_PATH_FIELD_NUMBER: _ClassVar[int]
    TARGET_STEP_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    model: str
    max_model_len: int
    vocab_size: int
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    engine_id: str
    backend: str
    device: str
    dtype: str
    load: EngineLoad
    max_loras: int
    max_lora_rank: int
    execution_path: str
    target_step_ms: float
    max_inflight: int
    def __init__(self, model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., engine_id: _Optional[str] = ..., backend: _Optional[str] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., load: _Optional[_Union[EngineLoad, _Mapping]] = ..., max_loras: _Optional[int] = ..., max_lora_rank: _Optional[int] = ..., execution_path: _Optional[str] = ..., target_step_ms: _Optional[float] = ..., max_inflight: _Optional[int] = ...) -> None: ...
