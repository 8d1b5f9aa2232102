"""collate_examples: padding, truncation direction, label masking and counts."""

from __future__ import annotations

import numpy as np
import pytest

from jaxtrain.data import CollateStats, collate_examples

PAD = 0


def test_right_padding_masks_and_labels():
    batch, stats = collate_examples(
        [{"input_ids": [5, 6, 7]}, {"input_ids": [8]}],
        seq_len=5,
        pad_token_id=PAD,
        return_stats=True,
    )
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert all(v.dtype == np.int32 and v.shape == (2, 5) for v in batch.values())
    np.testing.assert_array_equal(batch["input_ids"], [[5, 6, 7, 0, 0], [8, 0, 0, 0, 0]])
    np.testing.assert_array_equal(batch["attention_mask"], [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    np.testing.assert_array_equal(
        batch["labels"], [[5, 6, 7, -100, -100], [8, -100, -100, -100, -100]]
    )
    assert stats == CollateStats(num_truncated_tokens=0, num_padding_tokens=6)


def test_plain_call_returns_only_model_inputs():
    batch = collate_examples([{"input_ids": [1, 2]}], seq_len=2, pad_token_id=PAD)
    assert isinstance(batch, dict) and set(batch) == {"input_ids", "attention_mask", "labels"}


@pytest.mark.parametrize(
    ("mode", "kept"), [("keep_start", [1, 2, 3, 4]), ("keep_end", [3, 4, 5, 6])]
)
def test_truncation_keeps_the_requested_end(mode, kept):
    example = {
        "input_ids": [1, 2, 3, 4, 5, 6],
        "labels": [-100, -100, 3, 4, 5, 6],
        "attention_mask": [1, 1, 1, 1, 1, 0],
    }
    batch, stats = collate_examples(
        [example], seq_len=4, pad_token_id=PAD, truncation_mode=mode, return_stats=True
    )
    np.testing.assert_array_equal(batch["input_ids"][0], kept)
    full = {k: np.array(v) for k, v in example.items()}
    cut = slice(0, 4) if mode == "keep_start" else slice(2, 6)
    np.testing.assert_array_equal(batch["attention_mask"][0], full["attention_mask"][cut])
    expected_labels = np.where(full["attention_mask"] == 0, -100, full["labels"])[cut]
    np.testing.assert_array_equal(batch["labels"][0], expected_labels)
    assert stats.num_truncated_tokens == 2 and stats.num_padding_tokens == 0


def test_example_labels_and_mask_honoured():
    example = {
        "input_ids": [10, 11, 12, 13],
        "labels": [-100, -100, 12, 13],  # prompt masked
        "attention_mask": [1, 1, 1, 0],
    }
    batch = collate_examples([example], seq_len=6, pad_token_id=99)
    np.testing.assert_array_equal(batch["input_ids"][0], [10, 11, 12, 13, 99, 99])
    np.testing.assert_array_equal(batch["attention_mask"][0], [1, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(batch["labels"][0], [-100, -100, 12, -100, -100, -100])


def test_counts_accumulate_over_mixed_batch():
    examples = [{"input_ids": list(range(1, 11))}, {"input_ids": [1, 2]}, {"input_ids": []}]
    _, stats = collate_examples(examples, seq_len=4, pad_token_id=PAD, return_stats=True)
    assert stats.num_truncated_tokens == 6
    assert stats.num_padding_tokens == 2 + 4
    assert stats + stats == CollateStats(12, 12)


def test_numpy_inputs_and_default_mode_is_keep_end():
    batch = collate_examples([{"input_ids": np.arange(1, 9)}], seq_len=3, pad_token_id=PAD)
    np.testing.assert_array_equal(batch["input_ids"][0], [6, 7, 8])


def test_bad_examples_name_field_and_index():
    with pytest.raises(ValueError, match="example 1.*'labels'.*length 2.*length 3"):
        collate_examples(
            [{"input_ids": [1]}, {"input_ids": [1, 2, 3], "labels": [1, 2]}],
            seq_len=4,
            pad_token_id=PAD,
        )
    with pytest.raises(ValueError, match="example 0.*'input_ids'.*ints"):
        collate_examples([{"input_ids": "hello"}], seq_len=4, pad_token_id=PAD)
    with pytest.raises(ValueError, match="example 0 has no 'input_ids'"):
        collate_examples([{"text": "hello"}], seq_len=4, pad_token_id=PAD)
    with pytest.raises(ValueError, match="truncation_mode='middle'"):
        collate_examples(
            [{"input_ids": [1]}], seq_len=4, pad_token_id=PAD, truncation_mode="middle"
        )
