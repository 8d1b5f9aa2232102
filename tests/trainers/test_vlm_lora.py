"""Which weights of a vision-language model train (issue 50): a frozen vision tower keeps its
weights while the projector and decoder move; LoRA adapts the decoder only, exports to PEFT
(PEFT's model equals the merged export) and a stopped LoRA run resumes bit-exactly."""

from __future__ import annotations

import datasets
import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from trainer_fixtures import tiny_model
from vlm_fixtures import conversations, write_checkpoint

peft = pytest.importorskip("peft")
from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling  # noqa: E402

from jaxtrain.errors import ArgumentError  # noqa: E402
from jaxtrain.hf import AutoModelForCausalLM, load_tokenizer  # noqa: E402
from jaxtrain.models.lora import lora_projections  # noqa: E402
from jaxtrain.trainers import SFTArguments, SFTTrainer  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("gemma3_vlm_lora") / "base")


class StopAt:
    def __init__(self, step):
        self.step = step

    def on_step_end(self, trainer, state, metrics, step):
        if step == self.step:
            trainer.should_stop = True


def trainer(checkpoint, output_dir, **overrides) -> SFTTrainer:
    options = dict(
        output_dir=str(output_dir), max_steps=4, total_batch_size=4, max_sequence_length=48,
        images_per_row=2, packing=False, learning_rate=1e-2, warmup_steps=0,
        progress_bar="none", run_report=False, save_steps=2,
    )  # fmt: skip
    return SFTTrainer(
        arguments=SFTArguments(**{**options, **overrides}),
        model=AutoModelForCausalLM.from_pretrained(str(checkpoint)),
        dataset_train=datasets.Dataset.from_list(conversations(8)),
        processing_class=load_tokenizer(checkpoint),
    )


def weights(model, part: str) -> list[np.ndarray]:
    return [
        np.asarray(v[...])
        for _, v in nnx.iter_graph(getattr(model, part))
        if isinstance(v, nnx.Variable)
    ]


def test_a_frozen_vision_tower_keeps_its_weights(checkpoint, tmp_path):
    run = trainer(checkpoint, tmp_path / "frozen", max_steps=2, freeze_vision_tower=True)
    before = AutoModelForCausalLM.from_pretrained(str(checkpoint))
    after = run.model_from_state(run.train().state)
    tower = zip(weights(before.vision, "vision_tower"), weights(after.vision, "vision_tower"))
    assert all(np.array_equal(a, b) for a, b in tower)
    projector = zip(weights(before.vision, "multi_modal_projector"),
                    weights(after.vision, "multi_modal_projector"))  # fmt: skip
    assert not all(np.array_equal(a, b) for a, b in projector)
    with pytest.raises(ArgumentError, match="freeze_vision_tower=True, but LlamaForCausalLM"):
        text_only = SFTArguments(output_dir=str(tmp_path / "text"), freeze_vision_tower=True)
        SFTTrainer(arguments=text_only, model=tiny_model())


def test_lora_adapts_the_decoder_and_exports_to_peft(checkpoint, tmp_path):
    run = trainer(checkpoint, tmp_path / "lora", max_steps=2, lora_rank=4)
    adapted = ["/".join(map(str, path)) for path, _ in lora_projections(run.model)]
    assert adapted and all(p.startswith("language_model/") for p in adapted)
    state = run.train().state
    run.save_pretrained(state, tmp_path / "peft", lora_format="peft")
    run.save_pretrained(state, tmp_path / "merged")
    base = transformers.AutoModelForImageTextToText.from_pretrained(checkpoint)
    adapter = peft.PeftModel.from_pretrained(base, tmp_path / "peft")
    merged = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "merged")
    fresh = transformers.AutoModelForImageTextToText.from_pretrained(checkpoint)
    batch = DataCollatorForVisionLanguageModeling(load_tokenizer(checkpoint))(conversations(4))
    with torch.no_grad():
        theirs, ours, untouched = (m(**batch).logits for m in (adapter, merged, fresh))
    np.testing.assert_allclose(theirs.numpy(), ours.numpy(), rtol=1e-5, atol=1e-5)
    assert (theirs - untouched).abs().max() > 1e-2  # the adapters moved


def test_a_lora_vlm_run_resumes_bit_exactly(checkpoint, tmp_path):
    expected = trainer(checkpoint, tmp_path / "straight", lora_rank=4).train()
    stopped = trainer(checkpoint, tmp_path / "resumed", lora_rank=4)
    stopped.callbacks.append(StopAt(2))
    assert int(stopped.train().state.step) == 2
    resumed = trainer(checkpoint, tmp_path / "resumed", lora_rank=4).train()
    assert int(resumed.state.step) == 4
    for a, b in zip(jax.tree.leaves(expected.state), jax.tree.leaves(resumed.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
