from protos.sluice.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenizeItem(_message.Message):
    __slots__ = ("text", "chat", "add_generation_prompt", "add_special_tokens", "max_prompt_tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    chat: _common_pb2.ChatMessages
    add_generation_prompt: bool
    add_special_tokens: bool
    max_prompt_tokens: int
    def __init__(self, text: _Optional[str] = ..., chat: _Optional[_Union[_common_pb2.ChatMessages, _Mapping]] = ..., add_generation_prompt: bool = ..., add_special_tokens: bool = ..., max_prompt_tokens: _Optional[int] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("items", "sequence_number")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_NUMBER_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[TokenizeItem]
    sequence_number: int
    def __init__(self, items: _Optional[_Iterable[_Union[TokenizeItem, _Mapping]]] = ..., sequence_number: _Optional[int] = ...) -> None: ...

class TokenizeResult(_message.Message):
    __slots__ = ("token_ids", "error")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    error: _common_pb2.ItemError
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., error: _Optional[_Union[_common_pb2.ItemError, _Mapping]] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("results", "sequence_number", "error")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_NUMBER_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[TokenizeResult]
    sequence_number: int
    error: _common_pb2.ItemError
    def __init__(self, results: _Optional[_Iterable[_Union[TokenizeResult, _Mapping]]] = ..., sequence_number: _Optional[int] = ..., error: _Optional[_Union[_common_pb2.ItemError, _Mapping]] = ...) -> None: ...

class DetokenizeOptions(_message.Message):
    __slots__ = ("stop", "include_stop_str_in_output", "skip_special_tokens", "prompt_tail_ids")
    STOP_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TAIL_IDS_FIELD_NUMBER: _ClassVar[int]
    stop: _containers.RepeatedScalarFieldContainer[str]
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    prompt_tail_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, stop: _Optional[_Iterable[str]] = ..., include_stop_str_in_output: bool = ..., skip_special_tokens: bool = ..., prompt_tail_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeUpdate(_message.Message):
    __slots__ = ("request_id", "options", "token_ids", "finished", "cancel")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    options: DetokenizeOptions
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: bool
    cancel: bool
    def __init__(self, request_id: _Optional[str] = ..., options: _Optional[_Union[DetokenizeOptions, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., finished: bool = ..., cancel: bool = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("updates", "sequence_number")
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_NUMBER_FIELD_NUMBER: _ClassVar[int]
    updates: _containers.RepeatedCompositeFieldContainer[DetokenizeUpdate]
    sequence_number: int
    def __init__(self, updates: _Optional[_Iterable[_Union[DetokenizeUpdate, _Mapping]]] = ..., sequence_number: _Optional[int] = ...) -> None: ...

class TextDelta(_message.Message):
    __slots__ = ("request_id", "text", "stop_hit", "matched_stop", "closed", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    STOP_HIT_FIELD_NUMBER: _ClassVar[int]
    MATCHED_STOP_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    stop_hit: bool
    matched_stop: str
    closed: bool
    error: _common_pb2.ItemError
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., stop_hit: bool = ..., matched_stop: _Optional[str] = ..., closed: bool = ..., error: _Optional[_Union[_common_pb2.ItemError, _Mapping]] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("deltas", "sequence_number")
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_NUMBER_FIELD_NUMBER: _ClassVar[int]
    deltas: _containers.RepeatedCompositeFieldContainer[TextDelta]
    sequence_number: int
    def __init__(self, deltas: _Optional[_Iterable[_Union[TextDelta, _Mapping]]] = ..., sequence_number: _Optional[int] = ...) -> None: ...

class TokenizerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenizerInfo(_message.Message):
    __slots__ = ("model", "vocab_size", "eos_token_ids", "has_chat_template", "tokenize_session")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZE_SESSION_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    has_chat_template: bool
    tokenize_session: bool
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., has_chat_template: bool = ..., tokenize_session: bool = ...) -> None: ...
