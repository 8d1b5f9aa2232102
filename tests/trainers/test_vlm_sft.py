"""SFT of a vision-language model (Gemma 3) on image conversations in TRL's vision format
(issue 50): rows become the token ids and pixels TRL 1.16's vision collator makes with the
same processor; the loss, its gradient and token accuracy equal TRL's SFTTrainer on the same
batch; truncation never cuts an image; a run from the command line samples with an image and
exports a directory that transformers loads with its processor."""

from __future__ import annotations

import copy
import json
import os

import datasets
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
import yaml
from flax import nnx
from vlm_fixtures import conversations, picture, write_checkpoint

trl = pytest.importorskip("trl")
from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling  # noqa: E402

from jaxtrain.cli import main  # noqa: E402
from jaxtrain.data.errors import DatasetError  # noqa: E402
from jaxtrain.data.vision import VisionFeaturizer  # noqa: E402
from jaxtrain.hf import AutoModelForCausalLM, load_tokenizer  # noqa: E402
from jaxtrain.trainers import SFTArguments, SFTTrainer  # noqa: E402

RTOL = 1e-5
ROWS = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("gemma3_vlm") / "base")


@pytest.fixture(scope="module")
def processor(checkpoint):
    return load_tokenizer(checkpoint)


def featurizer(processor, **kwargs) -> VisionFeaturizer:
    options = dict(
        name="dataset_train", processor=processor, max_length=64, images_per_row=2,
        image_token_id=processor.tokenizer.image_token_id, image_shape=(3, 32, 32),
    )  # fmt: skip
    return VisionFeaturizer(**{**options, **kwargs})


def trl_batch(processor, rows) -> dict[str, torch.Tensor]:
    return DataCollatorForVisionLanguageModeling(processor)(copy.deepcopy(rows))


def test_rows_become_the_ids_and_pixels_of_trls_collator(processor):
    rows = conversations(ROWS)
    theirs = trl_batch(processor, rows)
    image = processor.tokenizer.image_token_id
    whole = featurizer(processor, completion_only_loss=False)(rows, range(ROWS))
    replies = featurizer(processor, completion_only_loss=True)(rows, range(ROWS))
    flat_pixels = np.concatenate([e["pixel_values"] for e in whole])
    np.testing.assert_array_equal(flat_pixels, theirs["pixel_values"].numpy())
    assert [len(row["images"]) for row in rows] == [len(e["pixel_values"]) for e in whole]
    for i, (mine, reply) in enumerate(zip(whole, replies)):
        n = len(mine["input_ids"])
        ids = theirs["input_ids"][i].numpy()
        np.testing.assert_array_equal(mine["input_ids"], ids[:n])
        assert theirs["attention_mask"][i, n:].sum() == 0  # the same length
        # The whole row is learned except the image's own tokens (TRL learns those too).
        expected = np.where(ids[:n] == image, -100, theirs["labels"][i, :n].numpy())
        np.testing.assert_array_equal(mine["labels"], expected)
        # completion_only_loss: the reply, its words and end of turn, and nothing else.
        learned = processor.tokenizer.convert_ids_to_tokens(
            reply["input_ids"][reply["labels"] >= 0]
        )
        assert learned == [*rows[i]["messages"][1]["content"].split(), "<end_of_turn>"]


def per_row_pixels(flat: np.ndarray, counts: list[int], slots: int) -> np.ndarray:
    """TRL's [images, C, H, W] (in order) as jaxtrain's [rows, slots, C, H, W]."""
    out = np.zeros((len(counts), slots, *flat.shape[1:]), np.float32)
    at = 0
    for row, count in enumerate(counts):
        out[row, :count] = flat[at : at + count]
        at += count
    return out


def test_sft_loss_gradient_and_accuracy_equal_trl(checkpoint, processor, tmp_path):
    rows = conversations(ROWS)
    hf = transformers.AutoModelForImageTextToText.from_pretrained(checkpoint).float()
    config = trl.SFTConfig(
        output_dir=str(tmp_path / "trl"), per_device_train_batch_size=ROWS, use_cpu=True,
        bf16=False, report_to=[], max_length=None,
    )  # fmt: skip
    trainer = trl.SFTTrainer(
        model=hf, args=config, train_dataset=datasets.Dataset.from_list(rows),
        processing_class=processor,
    )  # fmt: skip
    batch = trl_batch(processor, rows)
    trainer.model.train()
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, dict(batch))
    loss.backward()
    grads = [p.grad.double() for p in trainer.model.parameters() if p.grad is not None]
    norm = float(torch.sqrt(sum((g**2).sum() for g in grads)))
    projector = trainer.model.model.multi_modal_projector.mm_input_projection_weight.grad.numpy()
    accuracy = trainer._metrics["train"]["mean_token_accuracy"][-1]

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint))
    ours = SFTTrainer(
        arguments=SFTArguments(output_dir=str(tmp_path / "ours"), max_steps=1, packing=False,
                               total_batch_size=ROWS, max_sequence_length=64),
        model=model, processing_class=processor,
    )  # fmt: skip
    counts = [len(row["images"]) for row in rows]
    micro = {k: jnp.asarray(batch[k].numpy()) for k in ("input_ids", "attention_mask", "labels")}
    micro["pixel_values"] = jnp.asarray(
        per_row_pixels(batch["pixel_values"].numpy(), counts, slots=2)
    )
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def objective(params):
        sums = ours.compute_loss_sums(nnx.merge(graphdef, params, rest), micro, jax.random.key(0))
        return sums["loss_sum"] / sums["tokens"], sums

    our_grads, sums = jax.jit(jax.grad(objective, has_aux=True))(params)
    our_loss = float(sums["loss_sum"] / sums["tokens"])
    our_norm = float(
        np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree.leaves(our_grads)))
    )
    our_projector = np.asarray(
        our_grads["vision"]["multi_modal_projector"]["mm_input_projection"][...]
    )
    if os.environ.get("JAXTRAIN_SHOW_PARITY"):
        print("loss", our_loss, loss.item(), "norm", our_norm, norm)
    np.testing.assert_allclose(our_loss, loss.item(), rtol=RTOL)
    np.testing.assert_allclose(our_norm, norm, rtol=RTOL)
    scale = np.abs(projector).max()
    np.testing.assert_allclose(our_projector, projector, rtol=0, atol=RTOL * scale)
    np.testing.assert_allclose(float(sums["correct"] / sums["tokens"]), accuracy, rtol=RTOL)


def test_truncation_never_cuts_an_image(processor, caplog):
    rows = conversations(ROWS)  # row 1: two images (8 + 4 tokens) at the start, 27 tokens
    image = processor.tokenizer.image_token_id
    full = featurizer(processor)(rows[1:2], [1])[0]
    assert len(full["input_ids"]) == 27
    # keep_start at 20 tokens keeps both images whole: the text is cut, the pixels stay.
    cut = featurizer(processor, max_length=20)(rows[1:2], [1])[0]
    np.testing.assert_array_equal(cut["input_ids"], full["input_ids"][:20])
    assert len(cut["pixel_values"]) == 2
    # At 10 tokens the second image would lose its tokens: an error naming the row...
    with pytest.raises(DatasetError, match=r"dataset_train row 1 has 27 tokens.*cut an image"):
        featurizer(processor, max_length=10)(rows[1:2], [1])
    # ...and keep_end would lose the first image's.
    with pytest.raises(DatasetError, match="image_truncation='drop'"):
        featurizer(processor, max_length=20, truncation_mode="keep_end")(rows[1:2], [1])
    # "drop": an empty row (no loss, no image), counted and logged.
    dropping = featurizer(processor, max_length=10, image_truncation="drop")
    with caplog.at_level("WARNING", logger="jaxtrain.data"):
        kept, dropped = dropping([rows[3], rows[1]], [3, 1])
    assert len(dropped["input_ids"]) == 0 and len(dropped["pixel_values"]) == 0
    assert dropping.dropped_rows == 1 and "1 row(s) dropped so far" in caplog.text
    assert (kept["input_ids"] == image).sum() == 0 and len(kept["input_ids"]) == 10


def test_bad_image_rows_are_named(processor, tmp_path):
    rows = conversations(2)
    with pytest.raises(DatasetError, match="row 0 has 1 images but images_per_row=0"):
        featurizer(processor, images_per_row=0)(rows[:1], [0])
    missing = {**rows[0], "images": [str(tmp_path / "gone.png")]}
    with pytest.raises(DatasetError, match=r"row 5: image file .*gone.png' does not exist"):
        featurizer(processor)([missing], [5])
    placed = [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                           {"type": "text", "text": "describe this"}]}]  # fmt: skip
    with pytest.raises(DatasetError, match=r"2 image part\(s\) but the row has 1 image"):
        featurizer(processor)([{"images": [picture(0)], "messages": placed}], [2])


def test_image_rows_are_refused_where_their_images_would_be_dropped(
    checkpoint, processor, tmp_path
):
    """A text tokenizer (or a task that reads text only) would drop the images and train on
    the text alone: the dataset is refused up front, naming the row and the fix."""
    from jaxtrain.trainers import DPOArguments, DPOTrainer, KTOArguments, KTOTrainer
    from jaxtrain.trainers.grpo_prompts import read_prompts

    rows = conversations(ROWS)
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    options = dict(output_dir=str(tmp_path / "run"), max_steps=1, total_batch_size=ROWS,
                   max_sequence_length=48, packing=False)  # fmt: skip
    text_only = r"dataset_train row 0 has images, but the processing class .* text tokenizer"
    with pytest.raises(DatasetError, match=text_only + ".*AutoProcessor"):
        SFTTrainer(SFTArguments(**options), model, dataset_train=rows,
                   processing_class=processor.tokenizer)  # fmt: skip
    pairs = [{"images": r["images"], "prompt": "what is it?", "chosen": "a square",
              "rejected": "a circle"} for r in rows]  # fmt: skip
    with pytest.raises(DatasetError, match=text_only):
        DPOTrainer(DPOArguments(**options), model, dataset_train=pairs,
                   processing_class=processor.tokenizer)  # fmt: skip
    with pytest.raises(DatasetError, match=text_only):
        read_prompts([{"images": r["images"], "prompt": "what is it?"} for r in rows],
                     processor.tokenizer, limit=32)  # fmt: skip
    # The processor given to a task that reads text rows only (KTO).
    unpaired = [{**p, "completion": p["chosen"], "label": True} for p in pairs]
    for row in unpaired:
        del row["chosen"], row["rejected"]
    with pytest.raises(
        DatasetError, match="this task reads text rows only.*ids_to_pop_from_dataset"
    ):
        KTOTrainer(KTOArguments(**options), model, dataset_train=unpaired,
                   processing_class=processor)  # fmt: skip
    # Dropping the images is the user's explicit choice, and is taken.
    dropped = SFTArguments(**options, ids_to_pop_from_dataset=["images"])
    SFTTrainer(dropped, model, dataset_train=rows, processing_class=processor.tokenizer)


def test_a_tower_of_images_of_any_size_is_refused_for_image_rows(processor):
    """Qwen2.5-VL's images keep their sizes, which the data pipeline does not batch yet: its
    config has no image_shape, read below (an AttributeError traceback)."""
    from jaxtrain.data.vision import check_image_model
    from jaxtrain.errors import ArgumentError
    from jaxtrain.models.llama import LlamaConfig
    from jaxtrain.models.qwen25_vl import Qwen25VLConfig
    from jaxtrain.models.qwen25_vl_vision import Qwen25VisionConfig

    text = LlamaConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                       intermediate_size=64, num_hidden_layers=1, vocab_size=300)  # fmt: skip
    config = Qwen25VLConfig(
        text=text, vision=Qwen25VisionConfig(out_hidden_size=64), mrope_section=(4, 6, 6)
    )
    with pytest.raises(ArgumentError, match="Qwen25VLConfig's images keep their sizes"):
        check_image_model(processor, config)


def test_the_sample_of_prompt_and_completion_image_rows_asks_their_prompt(processor):
    from jaxtrain.data.images import place_images
    from jaxtrain.data.prompts import vision_sample_prompt
    from jaxtrain.data.vision import processed_prompt
    from jaxtrain.errors import ArgumentError

    image = picture(0)
    rows = [{"images": [image], "prompt": "what colour is it?", "completion": "red"}]
    ids, text, pixels = vision_sample_prompt(processor, rows)
    turn = place_images([{"role": "user", "content": "what colour is it?"}], 1, "row")
    expected, expected_pixels, _ = processed_prompt(processor, turn, [image])
    assert ids == expected and "what colour is it?" in text
    np.testing.assert_array_equal(pixels, expected_pixels)
    with pytest.raises(ArgumentError, match="no 'messages' or 'prompt' to sample from"):
        vision_sample_prompt(processor, [{"images": [image], "text": "a square"}])


def test_a_vlm_fine_tunes_from_the_command_line_and_exports(checkpoint, tmp_path, capsys):
    rows = []
    for i, row in enumerate(conversations(8)):
        paths = []
        for j, image in enumerate(row["images"]):
            image.save(tmp_path / f"{i}_{j}.png")
            paths.append(str(tmp_path / f"{i}_{j}.png"))
        rows.append({"images": paths, "messages": row["messages"]})
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    config = dict(
        task="sft", output_dir=str(run), max_steps=6, total_batch_size=4, learning_rate=3e-3,
        warmup_steps=0, max_sequence_length=48, images_per_row=2, packing=False,
        logging_steps=1, evaluation_strategy="no", progress_bar="none", report_to="jsonl",
        run_report=False, model={"pretrained": str(checkpoint)},
        data={"source": "files", "train_files": str(data)}, sample={"max_new_tokens": 4},
    )  # fmt: skip
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    assert main(["train", str(tmp_path / "run.yaml")]) == 0
    # The end-of-run sample: the first row's conversation with its image, then a reply.
    out = capsys.readouterr().out
    assert "--- sample" in out and "<start_of_image>" in out and "failed" not in out
    image = rows[0]["images"][0]
    assert main(["sample", str(run), "--image", image, "--prompt",
                 "what colour", "--max_new_tokens", "3"]) == 0  # fmt: skip
    sampled = capsys.readouterr().out.split("--- sample")[-1]
    assert "<start_of_image>" in sampled and "what colour" in sampled
    losses = [json.loads(line).get("loss") for line in (run / "metrics.jsonl").open()]
    losses = [x for x in losses if x is not None]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert main(["export", str(run), str(tmp_path / "out")]) == 0

    # transformers reads the export and its processor; the fine-tuned weights moved.
    exported = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "out")
    processor = transformers.AutoProcessor.from_pretrained(tmp_path / "out")
    base = transformers.AutoModelForImageTextToText.from_pretrained(checkpoint)
    batch = trl_batch(processor, conversations(4))
    with torch.no_grad():
        before = base(**batch).loss.item()
        after = exported(**batch).loss.item()
    assert after < before


def test_a_batch_counts_what_truncation_cut_and_padding_filled(processor):
    """Image rows are cut to max_sequence_length by the featurizer, before collation: the
    logged data/truncated_tokens and data/padding_tokens read 0."""
    from jaxtrain.data.assemble import Collation

    rows = conversations(ROWS)
    full = [len(e["input_ids"]) for e in featurizer(processor)(rows, list(range(ROWS)))]
    short = featurizer(processor, max_length=20)
    collation = Collation(
        name="dataset_train", seq_len=20, pad_token_id=short.pad_token_id,
        collator=short.collator,
    )  # fmt: skip
    fill = np.zeros(ROWS, bool)
    _, stats = collation(short(rows, list(range(ROWS))), fill, list(range(ROWS)))
    assert stats.num_truncated_tokens == sum(max(n - 20, 0) for n in full) > 0, full
    assert stats.num_padding_tokens == sum(max(20 - n, 0) for n in full) > 0, full
