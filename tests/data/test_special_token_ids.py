"""A special token id (pad, eos, bos) outside the model's vocabulary is an ArgumentError when
the Trainer is built, not a NaN loss at step 1 (an out-of-range id embeds as NaN)."""

from __future__ import annotations

import datasets
import pytest
from flax import nnx

from jaxtrain import Trainer, TrainingArguments
from jaxtrain.errors import ArgumentError
from jaxtrain.models import LlamaConfig, LlamaForCausalLM

VOCAB = 32


def build(tmp_path, tokenizer=None, **config):
    values = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1)
    values.update(num_attention_heads=2, num_key_value_heads=1, **config)
    rows = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3, 4]] * 8})
    args = TrainingArguments(
        output_dir=str(tmp_path / "run"),
        max_steps=1,
        total_batch_size=8,
        max_sequence_length=8,
        progress_bar="none",
    )
    model = LlamaForCausalLM(LlamaConfig(**values), rngs=nnx.Rngs(0))
    return Trainer(arguments=args, model=model, dataset_train=rows, processing_class=tokenizer)


def test_a_config_eos_outside_the_vocabulary_is_refused_before_it_pads(tmp_path):
    # No pad token anywhere: today's fallback pads with this eos id, which has no embedding.
    with pytest.raises(ArgumentError) as err:
        build(tmp_path, pad_token_id=None, eos_token_id=VOCAB, bos_token_id=1)
    message = str(err.value)
    assert "model config's eos_token_id=32" in message and "vocab_size=32" in message
    assert "Set model config eos_token_id to an id below 32" in message


@pytest.mark.parametrize(
    ("field", "value"), [("bos_token_id", -1), ("eos_token_id", [2, 40]), ("pad_token_id", 99)]
)
def test_every_special_id_of_the_config_is_checked(tmp_path, field, value):
    config = {"pad_token_id": 0, "eos_token_id": 2, "bos_token_id": 1, field: value}
    with pytest.raises(ArgumentError, match=f"model config's {field}="):
        build(tmp_path, **config)


def test_a_tokenizer_pad_token_outside_the_model_vocabulary_is_refused(tmp_path, chat_tokenizer):
    tokenizer = chat_tokenizer.__class__.from_pretrained(_saved(chat_tokenizer, tmp_path))
    tokenizer.add_special_tokens({"pad_token": "<extra-pad>"})  # a new id, past the model's
    assert len(tokenizer) == 18 and tokenizer.pad_token_id == 17
    with pytest.raises(ArgumentError, match=r"tokenizer's pad_token_id=17 .*vocab_size=17"):
        build(tmp_path, tokenizer, vocab_size=17, pad_token_id=0, eos_token_id=3, bos_token_id=2)


def test_ids_inside_the_vocabulary_still_train(tmp_path, chat_tokenizer):
    trainer = build(tmp_path, chat_tokenizer, pad_token_id=None, eos_token_id=3, bos_token_id=2)
    assert trainer.pad_token_id == 0  # the tokenizer's own pad token


def _saved(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path / "tok")
    return tmp_path / "tok"
