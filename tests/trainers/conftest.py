"""The task-trainer tests' tokenizer fixture: word-level, with a chat template. The other
helpers are in trainer_fixtures.py."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from trainer_fixtures import CHAT_TEMPLATE, WORDS
from transformers import PreTrainedTokenizerFast


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<unk>": 1, "<s>": 2, "</s>": 3, ":": 4}
    vocab.update({w: i + 5 for i, w in enumerate(WORDS)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="</s>"
    )
    out.chat_template = CHAT_TEMPLATE
    return out
