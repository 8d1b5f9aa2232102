"""`jaxtrain plan` of a vision-language model (issue 50): the planned step is the VLM SFT run's
compiled step (its image slots encoded by the vision tower), and a deep decoder is planned from
two of its layer units with the tower whole."""

from __future__ import annotations

import dataclasses
import json

import datasets
import jax
import pytest
from vlm_fixtures import conversations, write_checkpoint

from jaxtrain.hf import AutoModelForCausalLM, load_tokenizer
from jaxtrain.planning.program import plan_program, with_layers
from jaxtrain.trainers import SFTArguments, SFTTrainer


def test_a_vlm_plan_is_the_vlm_run_s_compiled_step(tmp_path):
    base = write_checkpoint(tmp_path / "base")
    model = AutoModelForCausalLM.from_pretrained(str(base))
    args = SFTArguments(
        output_dir=str(tmp_path / "run"), max_steps=1, total_batch_size=4, packing=False,
        max_sequence_length=48, images_per_row=2, progress_bar="none", run_report=False,
    )  # fmt: skip
    SFTTrainer(
        arguments=args, model=model, dataset_train=datasets.Dataset.from_list(conversations(8)),
        processing_class=load_tokenizer(base), devices=jax.devices()[:1],
    ).train()  # fmt: skip
    info = json.loads((tmp_path / "run" / "run_info.json").read_text())
    measured = info["train_step_memory"]["peak"]
    planned = dataclasses.replace(args, output_dir=str(tmp_path / "never"))
    figures = plan_program(model.config, planned, jax.devices()[:1], task="sft")
    assert figures["peak_bytes"] == pytest.approx(measured, rel=1e-6)
    # Four image slots a row: the tower encodes twice the images, a bigger step.
    more = dataclasses.replace(planned, images_per_row=4)
    bigger = plan_program(model.config, more, jax.devices()[:1], task="sft")
    assert bigger["peak_bytes"] > figures["peak_bytes"]


def test_a_deep_vlm_is_planned_from_its_layer_units(tmp_path):
    config = AutoModelForCausalLM.from_pretrained(str(write_checkpoint(tmp_path / "b"))).config
    deep = with_layers(config, 2)
    deep = dataclasses.replace(deep, text=dataclasses.replace(
        deep.text, num_hidden_layers=8, layer_types=["sliding_attention", "full_attention"] * 4))  # fmt: skip
    args = SFTArguments(output_dir=str(tmp_path / "never"), max_steps=1, total_batch_size=4,
                        packing=False, max_sequence_length=48)  # fmt: skip
    figures = plan_program(deep, args, jax.devices()[:1], task="sft")
    assert figures["method"].startswith("4 and 6 of 8 layers compiled")
    assert figures["peak_bytes"] > 0 and figures["num_parameters"] > config.vision.hidden_size**2
