"""`jaxtrain plan --task`: a task's plan is built from a Program alone (no Trainer, nothing
written) and its memory is the peak of the step the task's real run compiles."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import pytest
from trainer_fixtures import addition_pairs, tiny_arguments, tiny_config, tiny_model

from jaxtrain.config.sections import RunSettings
from jaxtrain.planning.program import plan_program
from jaxtrain.serving.warm_up import step_calls
from jaxtrain.trainers import (
    DPOArguments,
    DPOTrainer,
    GRPOArguments,
    GRPOTrainer,
    KTOArguments,
    KTOTrainer,
    ORPOArguments,
    ORPOTrainer,
    RLOOArguments,
    RLOOTrainer,
)
from jaxtrain.trainers.grpo_sampler import rollout_engine_shape


def run_peak(out: Path) -> float:
    return json.loads((out / "run" / "run_info.json").read_text())["train_step_memory"]["peak"]


def plan_peak(task: str, args, tmp_path: Path) -> float:
    """The plan of `args`' run, with its output_dir pointing somewhere that must stay empty."""
    nowhere = tmp_path / "never-written"
    args = dataclasses.replace(args, output_dir=str(nowhere))
    figures = plan_program(tiny_config(), args, jax.devices()[:1], task=task)
    assert not nowhere.exists()  # a plan writes nothing: no Trainer, no output directory
    return figures["peak_bytes"]


def test_a_dpo_plan_is_the_dpo_run_s_compiled_step(tokenizer, tmp_path):
    args = tiny_arguments(DPOArguments, tmp_path, max_steps=1, beta=0.1)
    DPOTrainer(
        arguments=args,
        model=tiny_model(),
        dataset_train=addition_pairs(),
        processing_class=tokenizer,
        devices=jax.devices()[:1],
    ).train()
    measured = run_peak(tmp_path)
    assert plan_peak("dpo", args, tmp_path) == pytest.approx(measured, rel=1e-6)
    # The reference is part of the program: without it the step is another one.
    free = tiny_arguments(DPOArguments, tmp_path, max_steps=1, reference_free=True)
    assert plan_peak("dpo", free, tmp_path) != pytest.approx(measured, rel=1e-6)


@pytest.mark.parametrize(
    "task, cls, args_cls, extra",
    [
        ("kto", KTOTrainer, KTOArguments, {}),
        ("orpo", ORPOTrainer, ORPOArguments, {"packing": True}),
        ("dpo", DPOTrainer, DPOArguments, {"packing": True}),
    ],
    ids=["kto", "orpo_packed", "dpo_packed"],
)
def test_a_preference_plan_is_its_run_s_compiled_step(
    tokenizer, tmp_path, task, cls, args_cls, extra
):
    """KTO's reference and KL rows, ORPO's global scalars, packed rows and unit slots: the
    plan compiles the step the run compiles."""
    args = tiny_arguments(args_cls, tmp_path, max_steps=1, **extra)
    cls(
        arguments=args,
        model=tiny_model(),
        dataset_train=addition_pairs(32),
        processing_class=tokenizer,
        devices=jax.devices()[:1],
    ).train()
    assert plan_peak(task, args, tmp_path) == pytest.approx(run_peak(tmp_path), rel=1e-6)


def test_a_grpo_plan_is_the_grpo_run_s_step_and_engine(tokenizer, tmp_path):
    """The train step's peak, and the engine GRPO samples on (it once planned the pre-engine
    sampler instead): the shapes it compiles (at least the run's), its page pool, and the
    largest of its programs' temporaries and peaks, as the run's own engine compiles them from
    its real arrays."""
    args = tiny_arguments(
        GRPOArguments,
        tmp_path,
        max_steps=1,
        total_batch_size=8,
        num_generations=4,
        max_prompt_length=8,
        max_completion_length=3,
        num_iterations=2,
        beta=0.04,
        # Its arrays joined the batch this session; the planner once kept its own copy of
        # the batch and would have planned the step without them.
        sampler_correction="token_truncate",
        rollout_warm_up=True,  # every decode shape compiled, as the plan compiles them
    )
    prompts = [{"prompt": f"what is {i % 7} + {i % 5} ?"} for i in range(8)]
    trainer = GRPOTrainer(
        arguments=args,
        model=tiny_model(),
        reward_funcs=[lambda prompts, completions, **_: [1.0] * len(completions)],
        dataset_train=prompts,
        processing_class=tokenizer,
        devices=jax.devices()[:1],
    )
    trainer.train()
    assert plan_peak("grpo", args, tmp_path) == pytest.approx(run_peak(tmp_path), rel=1e-6)
    nowhere = dataclasses.replace(args, output_dir=str(tmp_path / "never-written"))
    planned = plan_program(tiny_config(), nowhere, jax.devices()[:1], task="grpo")["sampler"]
    engine = trainer.train_source.engine
    # The plan knows no prompt: it compiles every bucket up to max_prompt_length and a
    # prefill of every slot, the run only those its prompts reach.
    for kind, shapes in engine.steps.compiles.items():
        assert len(shapes) <= planned["shapes"].get(kind, 0), kind
    assert planned["shapes"]["decode"] == len(engine.steps.compiles["decode"])
    pool = sum(x.nbytes for x in jax.tree.leaves(engine.pool))
    assert planned["memory"]["pool_bytes"] == pool > 0
    shape = rollout_engine_shape(RunSettings.from_arguments(args))
    real = [
        engine.steps.lower(kind, engine.state, engine.pool, *call).compile().memory_analysis()
        for kind, call in step_calls(shape, args.max_prompt_length)
    ]
    assert planned["memory"]["temporaries"] == max(m.temp_size_in_bytes for m in real)
    peak = max(
        m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
        + m.temp_size_in_bytes
        for m in real
    )  # fmt: skip
    assert planned["memory"]["peak"] == peak > pool


def test_an_rloo_plan_is_the_rloo_run_s_step_and_plans_its_engine(tokenizer, tmp_path):
    """RLOO's step (a ratio per completion, no reference in the step, old log-probs on later
    updates) is what its plan compiles; the plan includes the engine it samples on."""
    args = tiny_arguments(
        RLOOArguments, tmp_path, max_steps=1, total_batch_size=8, num_generations=4,
        max_prompt_length=8, max_completion_length=3, num_iterations=2,
    )  # fmt: skip
    prompts = [{"prompt": f"what is {i % 7} + {i % 5} ?"} for i in range(8)]
    RLOOTrainer(
        arguments=args, model=tiny_model(), dataset_train=prompts, processing_class=tokenizer,
        reward_funcs=[lambda prompts, completions, **_: [1.0] * len(completions)],
        devices=jax.devices()[:1],
    ).train()  # fmt: skip
    assert plan_peak("rloo", args, tmp_path) == pytest.approx(run_peak(tmp_path), rel=1e-6)
    nowhere = dataclasses.replace(args, output_dir=str(tmp_path / "never-written"))
    planned = plan_program(tiny_config(), nowhere, jax.devices()[:1], task="rloo")
    assert planned["sampler"]["memory"]["pool_bytes"] > 0
    # A deeper policy compiles 2 and 3 of its layers and scales them; its engine is planned
    # on the whole model (that plan once read the full Program after dropping it).
    deep = plan_program(tiny_config(num_hidden_layers=7), nowhere, jax.devices()[:1], task="rloo")
    assert deep["method"].startswith("2 and 3 of 7 layers compiled")
    assert deep["sampler"]["memory"]["pool_bytes"] == 7 * planned["sampler"]["memory"]["pool_bytes"]


def test_a_qlora_plan_counts_the_quantized_base_as_the_run_does(tmp_path):
    """The plan of a LoRA run on an NF4 base is the run's compiled step: its codes and scales
    are frozen state of the Program, as in the run."""
    from trainer_fixtures import tiny_model

    from jaxtrain import Trainer, TrainingArguments

    args = tiny_arguments(
        TrainingArguments, tmp_path, max_steps=1, lora_rank=4, quantization="nf4",
        quantization_block_size=32,
    )  # fmt: skip
    rows = [{"input_ids": [(7 * i + j) % 60 + 3 for j in range(16)]} for i in range(16)]
    Trainer(
        arguments=args, model=tiny_model(), dataset_train=rows, devices=jax.devices()[:1]
    ).train()
    assert plan_peak("lm", args, tmp_path) == pytest.approx(run_peak(tmp_path), rel=1e-6)

    # The frozen base is in the plan's state: its float kernels replaced by codes and scales.
    from jaxtrain.config.sections import ModelSettings
    from jaxtrain.quantization.kernel import quantized_bytes
    from jaxtrain.training.program import add_lora, quantize

    def frozen(**kw) -> float:
        run = dataclasses.replace(args, output_dir=str(tmp_path / "never-written"), **kw)
        figures = plan_program(tiny_config(), run, jax.devices()[:1], task="lm")
        assert figures["shape_estimate_bytes"] > figures["state"]["frozen"]
        return figures["state"]["frozen"]

    settings = ModelSettings.from_arguments(args)
    stored, bf16 = quantized_bytes(quantize(add_lora(tiny_model(), settings), settings))
    float_kernels = bf16 // 2 * 4  # the tiny model's parameters are float32
    assert frozen(quantization=None) - frozen() == float_kernels - stored


def test_a_grpo_plan_with_rollout_devices_trains_on_the_others(tmp_path, capsys):
    """`rollout_devices` r once changed nothing in the plan (the step planned on every device,
    the engine on them too) and `max_staleness`' parameter copies were not counted. On 2 devices
    with r = 1: the step is the one-device plan's, the engine sits replicated on the other."""
    from jaxtrain.cli import main
    from jaxtrain.planning.program import build_config

    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=1, vocab_size=64)  # fmt: skip
    run = dict(num_generations=2, total_batch_size=4, max_prompt_length=8,
               max_completion_length=4, max_staleness=1, max_steps=1, warmup_steps=0)  # fmt: skip
    flags = [f"--{k}={v}" for k, v in run.items()] + [f"--model.{k}={v}" for k, v in sizes.items()]
    out = tmp_path / "plan.json"
    argv = ["plan", "--task", "grpo", "--devices", "2", "--rollout_devices", "1", *flags]
    assert main([*argv, "--compiler", "cpu", "--output", str(out)]) == 0
    assert "1 of them the engine's (rollout_devices)" in capsys.readouterr().out
    plan = json.loads(out.read_text())
    (entry,) = plan["meshes"]
    figures = entry["figures"]
    alone = {**plan["arguments"], "rollout_devices": 0, "output_dir": str(tmp_path / "x")}
    args = GRPOArguments.from_dict(alone)  # the CLI's run (the demo's settings), all on 1
    one = plan_program(build_config(plan["model"]), args, jax.devices()[:1], task="grpo")
    assert figures["devices"] == 1 and figures["peak_bytes"] == one["peak_bytes"]
    sampler = figures["sampler"]
    assert sampler["devices"] == 1 and one["sampler"]["devices"] is None
    # One round in flight: a copy of the whole policy on the engine's device.
    params = 4 * one["num_parameters"]  # float32
    assert sampler["async_copies_bytes"] == one["sampler"]["async_copies_bytes"] == params
    assert sampler["memory"]["pool_bytes"] == one["sampler"]["memory"]["pool_bytes"]
