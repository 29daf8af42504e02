"""Tokenizers for the tokenizer-service tests.

- `smollm`: the default model's tokenizer (SmolLM2: byte-level BPE, like Llama 3), loaded once.
- `byte_fallback`: a small SentencePiece-style BPE built in memory (Llama 2 / Mistral style:
  `▁` for spaces, `<0x..>` byte-fallback tokens, a decoder that strips the first leading space),
  so byte-fallback decoding is tested without any download.
"""

from __future__ import annotations

import string

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers

from services.tokenizer.tokenize import TokenizerModel


@pytest.fixture(scope="session")
def smollm() -> TokenizerModel:
    return TokenizerModel.load(None)


def build_byte_fallback_tokenizer() -> Tokenizer:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for character in "▁" + string.ascii_letters + string.digits + ".,!?'-":
        vocab.setdefault(character, len(vocab))
    merges = [
        ("▁", "t"),
        ("h", "e"),
        ("▁t", "he"),
        ("▁", "a"),
        ("i", "n"),
        ("▁", "w"),
        ("o", "r"),
        ("▁w", "or"),
    ]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>")
    )
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tokenizer.add_special_tokens(["<s>", "</s>"])
    return tokenizer


@pytest.fixture(scope="session")
def byte_fallback() -> Tokenizer:
    return build_byte_fallback_tokenizer()
