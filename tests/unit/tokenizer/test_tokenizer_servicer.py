"""The Tokenize RPC's two ways to encode: short text batches inline, the rest on the pool."""

from __future__ import annotations

import asyncio

from protos.sluice.v1 import common_pb2, tokenizer_pb2
from services.tokenizer import server
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.tokenize import EncodeItem


def _tokenize(servicer: server.TokenizerServicer, items: list) -> list:
    request = tokenizer_pb2.TokenizeRequest(items=items)
    return list(asyncio.run(servicer.Tokenize(request, None)).results)


def test_short_and_long_batches_encode_the_same_as_the_model(smollm) -> None:
    servicer = server.TokenizerServicer(smollm, TokenizerConfig())
    try:
        short = "The quick brown fox jumps over the lazy dog."
        long = "All work and no play makes a dull model. " * 80  # past the inline limit
        assert len(long) > server.INLINE_ENCODE_MAX_CHARS
        for texts in ([short], [short, long]):
            results = _tokenize(servicer, [tokenizer_pb2.TokenizeItem(text=t) for t in texts])
            assert [list(r.token_ids) for r in results] == [smollm.encode_text(t) for t in texts]
        chat = common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(role="user", content="hi")])
        (result,) = _tokenize(servicer, [tokenizer_pb2.TokenizeItem(chat=chat)])
        assert list(result.token_ids) and not result.HasField("error")
    finally:
        servicer.shutdown()


def test_only_plain_short_texts_are_encoded_inline() -> None:
    assert server._short_texts([EncodeItem(text="a"), EncodeItem(text="b")])
    assert not server._short_texts([EncodeItem(text="x" * (server.INLINE_ENCODE_MAX_CHARS + 1))])
    assert not server._short_texts([EncodeItem(chat=[{"role": "user", "content": "hi"}])])
    assert not server._short_texts([EncodeItem()])  # neither: the pool reports the error
