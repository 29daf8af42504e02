"""OpenAI request bodies -> the router's GenerateRequest, validated strictly.

Every field is either mapped onto Sluice's sampling parameters, accepted because it cannot
change the output (`user`, `n: 1`, `echo: false`, `logit_bias: {}` ...), or refused with 400
naming it: a field this server does not honour must never be ignored silently. The ranges of
the sampling values are checked once, by the router core, with the same messages as on gRPC;
here only types and what protobuf cannot hold are checked.

Extensions beyond OpenAI's fields (as vLLM offers them): top_k, min_p, min_tokens,
repetition_penalty, ignore_eos, stop_token_ids, include_stop_str_in_output, priority.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from protos.sluice.v1 import common_pb2, router_pb2
from services.router.openai_http.errors import RequestError

UINT32_MAX = 2**32 - 1
INT32_MAX = 2**31 - 1

# name -> the type it must have (null is always accepted and means "the default")
SAMPLING_FIELDS = {
    "temperature": "number",
    "top_p": "number",
    "seed": "integer",
    "presence_penalty": "number",
    "frequency_penalty": "number",
    "top_k": "integer",
    "min_p": "number",
    "min_tokens": "integer",
    "repetition_penalty": "number",
    "ignore_eos": "boolean",
    "include_stop_str_in_output": "boolean",
}
COMMON_FIELDS = frozenset(
    {"model", "max_tokens", "stream", "stream_options", "stop", "stop_token_ids", "n"}
    | {"logit_bias", "user", "priority", "logprobs"}
    | set(SAMPLING_FIELDS)
)
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = (
    COMMON_FIELDS
    | {"messages", "max_completion_tokens", "top_logprobs"}
    | {
        "response_format",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
    }
)
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


@dataclass
class OpenAIRequest:
    """A validated body: the GenerateRequest to run and how to answer it."""

    generate: router_pb2.GenerateRequest
    model: str
    chat: bool
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False


def parse_completion(body: Any) -> OpenAIRequest:
    """A `/v1/completions` body; raises RequestError naming the first bad field."""
    fields = _Fields(body, COMPLETION_FIELDS)
    request = _common(fields, chat=False)
    _prompt(fields, request.generate)
    _only(fields, "echo", "boolean", (False,))
    _only(fields, "best_of", "integer", (1,))
    _only(fields, "suffix", "string", ("",))
    logprobs = fields.get("logprobs", "integer")
    if logprobs is not None:
        request.generate.params.logprobs = _bounded("logprobs", logprobs, 0, UINT32_MAX)
        request.logprobs = True
    return request


def parse_chat(body: Any) -> OpenAIRequest:
    """A `/v1/chat/completions` body; raises RequestError naming the first bad field."""
    fields = _Fields(body, CHAT_FIELDS)
    request = _common(fields, chat=True)
    _messages(fields, request.generate)
    limit = fields.get("max_completion_tokens", "integer")
    if limit is not None:
        request.generate.params.max_tokens = _bounded("max_completion_tokens", limit, 0, UINT32_MAX)
    top = fields.get("top_logprobs", "integer")
    if fields.get("logprobs", "boolean"):
        request.generate.params.logprobs = 0 if top is None else _bounded("top_logprobs", top)
        request.logprobs = True
    elif top is not None:
        raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    response_format = fields.get("response_format", "object")
    if response_format not in (None, {"type": "text"}):
        raise RequestError(
            "response_format: only {'type': 'text'} is supported", param="response_format"
        )
    if fields.get("tools", "array"):
        raise RequestError("tools are not supported", param="tools")
    _only(fields, "tool_choice", "string", ("none", "auto"))
    fields.get("parallel_tool_calls", "boolean")
    return request


def _common(fields: _Fields, *, chat: bool) -> OpenAIRequest:
    model = fields.get("model", "string")
    if not model:
        raise RequestError("model is required", param="model")
    generate = router_pb2.GenerateRequest(params=common_pb2.SamplingParams())
    params = generate.params
    max_tokens = fields.get("max_tokens", "integer")
    if max_tokens is not None:
        params.max_tokens = _bounded("max_tokens", max_tokens, 0, UINT32_MAX)
    for name, kind in SAMPLING_FIELDS.items():
        value = fields.get(name, kind)
        if value is None:
            continue
        if kind == "integer":
            value = _bounded(name, value, 0, 2**64 - 1 if name == "seed" else UINT32_MAX)
        setattr(params, name, value)
    stop = fields.get("stop", "string_or_array")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        for position, text in enumerate(stop):
            if not isinstance(text, str):
                raise RequestError(f"stop[{position}] must be a string", param="stop")
        params.stop.extend(stop)
    for position, token_id in enumerate(fields.get("stop_token_ids", "array") or ()):
        params.stop_token_ids.append(_bounded(f"stop_token_ids[{position}]", token_id))
    priority = fields.get("priority", "integer")
    if priority is not None:
        generate.priority = _bounded("priority", priority, -INT32_MAX, INT32_MAX)
    _only(fields, "n", "integer", (1,))
    if fields.get("logit_bias", "object"):
        raise RequestError("logit_bias is not supported", param="logit_bias")
    fields.get("user", "string")
    stream = bool(fields.get("stream", "boolean"))
    options = fields.get("stream_options", "object")
    include_usage = False
    if options is not None:
        if not stream:
            raise RequestError("stream_options needs stream: true", param="stream_options")
        for key in options:
            if key != "include_usage":
                raise RequestError(f"stream_options.{key} is not supported", param="stream_options")
        include_usage = _typed(
            "stream_options.include_usage", options.get("include_usage"), "boolean"
        )
    return OpenAIRequest(generate, model, chat, stream, bool(include_usage))


def _prompt(fields: _Fields, generate: router_pb2.GenerateRequest) -> None:
    prompt = fields.body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        generate.prompt = prompt
        return
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        for position, token_id in enumerate(prompt):
            generate.prompt_token_ids.ids.append(_bounded(f"prompt[{position}]", token_id))
        return
    if isinstance(prompt, list) and len(prompt) > 1:
        raise RequestError(
            "send one prompt per request (batches are not supported)", param="prompt"
        )
    raise RequestError("prompt is required: a string or a list of token ids", param="prompt")


def _messages(fields: _Fields, generate: router_pb2.GenerateRequest) -> None:
    messages = fields.get("messages", "array")
    if not messages:
        raise RequestError("messages is required: a non-empty list", param="messages")
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise RequestError(f"{where} must be an object", param="messages")
        for key in message:
            if key not in ("role", "content"):
                raise RequestError(f"{where}.{key} is not supported", param="messages")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise RequestError(
                f"{where}.role must be one of {sorted(CHAT_ROLES)}, got {role!r}", param="messages"
            )
        generate.chat.messages.add(role=CHAT_ROLES[role], content=_content(message, where))


def _content(message: dict, where: str) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(
            f"{where}.content must be a string or a list of text parts", param="messages"
        )
    texts = []
    for index, part in enumerate(content):
        if (
            not isinstance(part, dict)
            or part.get("type") != "text"
            or set(part) != {"type", "text"}
        ):
            raise RequestError(
                f"{where}.content[{index}]: only {{'type': 'text', 'text': ...}} parts are "
                "supported",
                param="messages",
            )
        texts.append(_typed(f"{where}.content[{index}].text", part["text"], "string"))
    return "\n".join(texts)


class _Fields:
    """The body's fields, refusing any the server does not know."""

    def __init__(self, body: Any, allowed: frozenset[str]) -> None:
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        for name in body:
            if name not in allowed:
                raise RequestError(f"unsupported field '{name}'", param=name)
        self.body = body

    def get(self, name: str, kind: str) -> Any:
        return _typed(name, self.body.get(name), kind)


def _typed(name: str, value: Any, kind: str) -> Any:
    if value is None or _CHECKS[kind](value):
        return value
    article = "an" if kind[0] in "aeiou" else "a"
    label = "string or an array" if kind == "string_or_array" else kind
    raise RequestError(f"{name} must be {article} {label}, got {value!r:.80}", param=name)


def _only(fields: _Fields, name: str, kind: str, accepted: tuple) -> None:
    """A field accepted only with the value(s) this server always behaves as."""
    value = fields.get(name, kind)
    if value is not None and value not in accepted:
        allowed = " or ".join(repr(a) for a in accepted)
        raise RequestError(f"{name} must be {allowed} here, got {value!r:.80}", param=name)


def _bounded(name: str, value: Any, low: int = 0, high: int = UINT32_MAX) -> int:
    if not _is_int(value):
        raise RequestError(f"{name} must be an integer, got {value!r:.80}", param=name)
    if not low <= value <= high:
        raise RequestError(f"{name} must be in {low}..{high}, got {value}", param=name)
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_CHECKS = {
    "integer": _is_int,
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "string_or_array": lambda v: isinstance(v, (str, list)),
}
