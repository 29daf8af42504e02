"""Mapping and strict validation of OpenAI request bodies onto GenerateRequest."""

from __future__ import annotations

import pytest

from services.router.openai_http.errors import RequestError
from services.router.openai_http.requests import parse_chat, parse_completion


def completion(**fields) -> dict:
    return {"model": "m", "prompt": "Hello", **fields}


def chat(**fields) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "Hi"}], **fields}


def test_completion_maps_every_sampling_field_and_extension() -> None:
    parsed = parse_completion(
        completion(
            max_tokens=7,
            temperature=0.5,
            top_p=0.9,
            seed=3,
            stop=["\n", "END"],
            presence_penalty=0.1,
            frequency_penalty=-0.2,
            logprobs=2,
            top_k=5,
            min_p=0.05,
            min_tokens=2,
            repetition_penalty=1.1,
            ignore_eos=True,
            stop_token_ids=[2, 3],
            include_stop_str_in_output=True,
            priority=-4,
            n=1,
            echo=False,
            best_of=1,
            logit_bias={},
            user="alice",
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    request, params = parsed.generate, parsed.generate.params
    assert request.prompt == "Hello" and request.priority == -4
    assert (params.max_tokens, params.seed, params.top_k, params.min_tokens) == (7, 3, 5, 2)
    assert params.temperature == pytest.approx(0.5) and params.top_p == pytest.approx(0.9)
    assert params.presence_penalty == pytest.approx(0.1)
    assert params.frequency_penalty == pytest.approx(-0.2)
    assert params.min_p == pytest.approx(0.05)
    assert params.repetition_penalty == pytest.approx(1.1)
    assert list(params.stop) == ["\n", "END"] and list(params.stop_token_ids) == [2, 3]
    assert params.ignore_eos and params.include_stop_str_in_output
    assert params.logprobs == 2 and parsed.logprobs
    assert parsed.stream and parsed.include_usage and not parsed.chat


def test_unset_fields_keep_the_server_defaults() -> None:
    params = parse_completion(completion()).generate.params
    for name in ("max_tokens", "temperature", "top_p", "seed", "logprobs"):
        assert not params.HasField(name)
    assert parse_completion(completion(max_tokens=None, stop=None)).generate.params.stop == []


def test_prompt_forms() -> None:
    assert parse_completion(completion(prompt=["one"])).generate.prompt == "one"
    ids = parse_completion(completion(prompt=[1, 2, 3])).generate.prompt_token_ids.ids
    assert list(ids) == [1, 2, 3]
    assert list(parse_completion(completion(prompt=[[4, 5]])).generate.prompt_token_ids.ids) == [
        4,
        5,
    ]
    with pytest.raises(RequestError, match="one prompt per request"):
        parse_completion(completion(prompt=["a", "b"]))
    with pytest.raises(RequestError, match="prompt is required"):
        parse_completion({"model": "m"})
    with pytest.raises(RequestError, match=r"prompt\[1\]"):
        parse_completion(completion(prompt=[1, -2]))


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"frobnicate": 1}, "frobnicate"),
        ({"n": 2}, "n"),
        ({"best_of": 3}, "best_of"),
        ({"echo": True}, "echo"),
        ({"suffix": "x"}, "suffix"),
        ({"logit_bias": {"5": 1}}, "logit_bias"),
        ({"max_tokens": "ten"}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"stream": "yes"}, "stream"),
        ({"stop": 5}, "stop"),
        ({"stop": ["ok", 5]}, "stop"),
        ({"seed": -1}, "seed"),
        ({"model": 5}, "model"),
        ({"model": ""}, "model"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        ({"stop_token_ids": [1, "2"]}, "stop_token_ids[1]"),
        ({"priority": 2**40}, "priority"),
    ],
)
def test_bad_completion_fields_name_the_field(fields: dict, param: str) -> None:
    with pytest.raises(RequestError) as raised:
        parse_completion(completion(**fields))
    assert raised.value.param == param
    assert raised.value.code == "INVALID_ARGUMENT"
    assert param.split("[")[0].split(".")[0] in raised.value.message


def test_body_must_be_an_object() -> None:
    for body in ([], "text", 5, None):
        with pytest.raises(RequestError, match="JSON object"):
            parse_completion(body)


def test_chat_maps_messages_roles_and_text_parts() -> None:
    parsed = parse_chat(
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "assistant", "content": "ok"},
            ],
            "max_completion_tokens": 9,
            "logprobs": True,
            "top_logprobs": 3,
            "response_format": {"type": "text"},
            "tool_choice": "none",
            "parallel_tool_calls": False,
        }
    )
    turns = [(m.role, m.content) for m in parsed.generate.chat.messages]
    assert turns == [("system", "Be brief."), ("user", "a\nb"), ("assistant", "ok")]
    assert parsed.generate.params.max_tokens == 9
    assert parsed.generate.params.logprobs == 3 and parsed.logprobs and parsed.chat


def test_chat_logprobs_without_top_asks_for_the_chosen_token_only() -> None:
    parsed = parse_chat(chat(logprobs=True))
    assert parsed.generate.params.logprobs == 0 and parsed.logprobs
    parsed = parse_chat(chat(logprobs=False))
    assert not parsed.generate.params.HasField("logprobs") and not parsed.logprobs


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages"),
        ({"messages": [{"role": "user", "content": None}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": 2}, "logprobs"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"prompt": "x"}, "prompt"),
        ({"echo": False}, "echo"),
    ],
)
def test_bad_chat_fields_name_the_field(fields: dict, param: str) -> None:
    with pytest.raises(RequestError) as raised:
        parse_chat(chat(**fields))
    assert raised.value.param == param
