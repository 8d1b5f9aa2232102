"""Packed image conversations (issue 50): documents share rows while their tokens fit the row
and their images its image slots; each document's loss equals its loss alone in a padded row
(its images seen only by its own tokens); a packed VLM run trains through the Trainer and
evaluates on unpacked image rows."""

from __future__ import annotations

import datasets
import jax.numpy as jnp
import numpy as np
import pytest
from vlm_fixtures import conversations, write_checkpoint

from jaxtrain.data.packing import ImageSlots, Packer, best_fit_decreasing
from jaxtrain.data.vision import VisionFeaturizer
from jaxtrain.hf import AutoModelForCausalLM, load_tokenizer
from jaxtrain.trainers import SFTArguments, SFTTrainer
from jaxtrain.training.step import causal_lm_rows

SLOTS = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("gemma3_vlm_packing") / "base")


@pytest.fixture(scope="module")
def examples(checkpoint):
    processor = load_tokenizer(checkpoint)
    featurizer = VisionFeaturizer(
        name="dataset_train", processor=processor, max_length=64, images_per_row=2,
        image_token_id=processor.tokenizer.image_token_id, image_shape=(3, 32, 32),
        completion_only_loss=True,
    )  # fmt: skip
    return featurizer, featurizer(conversations(8), range(8))


def test_best_fit_respects_the_image_slots():
    # Lengths alone would put items 0 and 1 in one bin; their images (2 + 2) do not fit 3.
    assert best_fit_decreasing([4, 4, 3], 8) == [[0, 1], [2]]
    assert best_fit_decreasing([4, 4, 3], 8, images=[2, 2, 0], image_capacity=3) == [[0, 2], [1]]


def losses(model, batch) -> np.ndarray:
    logits = model(jnp.asarray(batch["input_ids"]), jnp.asarray(batch["pixel_values"]),
                   positions=batch.get("positions"), segment_ids=batch.get("segment_ids"))  # fmt: skip
    _, rows = causal_lm_rows(logits, jnp.asarray(batch["labels"]))
    return np.asarray(rows["nll"], np.float64)


def test_packed_image_rows_have_the_unpacked_losses(checkpoint, examples):
    featurizer, docs = examples
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint))
    packer = Packer(
        iter([((0, i), doc) for i, doc in enumerate(docs)]), seq_len=64, shuffle=False,
        pad_token_id=featurizer.pad_token_id, image_slots=ImageSlots(SLOTS, (3, 32, 32)),
    )  # fmt: skip
    rows = []
    with pytest.raises(StopIteration):  # the one block's rows, then the stream's end
        while True:
            rows.append(packer.next_row()[0])
    assert len(rows) < len(docs)
    packed = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    assert packed["segment_ids"].max() > 2  # rows hold several documents
    images = (packed["input_ids"] == featurizer.image_token_id).sum(axis=1) // 4
    assert images.max() <= SLOTS and images.sum() == sum(len(d["pixel_values"]) for d in docs)
    alone = featurizer.collator(docs)
    np.testing.assert_allclose(losses(model, packed).sum(), losses(model, alone).sum(), rtol=1e-6)
    # The images matter: other pixels in the packed rows give another loss.
    moved = {**packed, "pixel_values": np.roll(packed["pixel_values"], 1, axis=1)}
    assert abs(losses(model, moved).sum() - losses(model, packed).sum()) > 1e-3


def test_a_packed_vlm_run_trains(checkpoint, tmp_path):
    args = SFTArguments(
        output_dir=str(tmp_path / "run"), max_steps=3, total_batch_size=2,
        max_sequence_length=64, images_per_row=SLOTS, learning_rate=3e-3, warmup_steps=0,
        logging_steps=1, progress_bar="none", run_report=False, save_final=False,
        evaluation_strategy="steps", eval_steps=3,
    )  # fmt: skip
    assert args.packing  # SFT packs when the run has a length
    trainer = SFTTrainer(
        arguments=args, model=AutoModelForCausalLM.from_pretrained(str(checkpoint)),
        dataset_train=datasets.Dataset.from_list(conversations(8)),
        dataset_eval=datasets.Dataset.from_list(conversations(4)),  # one conversation a row
        processing_class=load_tokenizer(checkpoint),
    )  # fmt: skip
    batch = next(iter(trainer.train_source.loader.batches()))
    assert batch["pixel_values"].shape == (1, 2, SLOTS, 3, 32, 32)
    assert batch["segment_ids"].max() > 1
    output = trainer.train()
    assert np.isfinite(output.metrics["loss"]) and np.isfinite(output.metrics["eval/loss"])
    assert output.metrics["eval/tokens"] > 0
