"""KTOTrainer, ORPOTrainer and CPOTrainer (SimPO) as runs: step-0 values, learning on the
synthetic preference set, what reaches metrics.jsonl, LoRA, an exact resume and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from trainer_fixtures import StepMetrics, addition_pairs, tiny_arguments, tiny_model

from jaxtrain.arguments import ArgumentError
from jaxtrain.data.errors import DatasetError
from jaxtrain.trainers import (
    CPOArguments,
    CPOTrainer,
    KTOArguments,
    KTOTrainer,
    ORPOArguments,
    ORPOTrainer,
)


def logs_of(trainer) -> list[dict]:
    text = Path(trainer.arguments.output_dir, "metrics.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


def run(cls, args_cls, tmp_path, tokenizer, steps=10, rows=None, **overrides):
    seen = StepMetrics()
    args = tiny_arguments(args_cls, tmp_path, max_steps=steps, logging_steps=steps, **overrides)
    trainer = cls(
        arguments=args,
        model=tiny_model(),
        dataset_train=rows or addition_pairs(16),
        dataset_eval=rows or addition_pairs(16),
        processing_class=tokenizer,
        callbacks=[seen],
    )
    return trainer, trainer.train(), seen


@pytest.fixture(scope="module")
def orpo(tokenizer, tmp_path_factory):
    return run(ORPOTrainer, ORPOArguments, tmp_path_factory.mktemp("orpo"), tokenizer, beta=0.5)


def test_orpo_learns_the_preferences_and_logs_a_token_mean_nll(orpo):
    trainer, out, seen = orpo
    first, last = seen.steps[0], seen.steps[-1]
    assert last["loss_sum"] / last["tokens"] < first["loss_sum"] / first["tokens"]
    assert out.metrics["eval/accuracy"] > 0.8
    # At step 0 the loss is the token-mean NLL of the chosen sequences - beta x mean log
    # sigmoid(log odds): both logged, the first per token (nll_loss_count), the second per pair.
    nll = first["nll_loss_sum"] / first["nll_loss_count"]
    ratio = first["log_odds_ratio_sum"] / first["tokens"]
    assert first["loss_sum"] / first["tokens"] == pytest.approx(nll - 0.5 * ratio, rel=1e-5)
    assert first["nll_loss_count"] > 2 * first["tokens"]  # tokens, not pairs
    logged = [entry for entry in logs_of(trainer) if "nll_loss" in entry]
    assert logged and "perplexity" not in logged[0] and "log_odds_chosen" in logged[0]
    assert "eval/nll_loss" in out.metrics and "eval/log_odds_ratio" in out.metrics


def test_simpo_has_no_reference_and_no_nll_term(tokenizer, tmp_path):
    trainer, out, seen = run(
        CPOTrainer,
        CPOArguments,
        tmp_path,
        tokenizer,
        steps=6,
        loss_type="simpo",
        cpo_alpha=0.0,
        simpo_gamma=0.5,
        beta=2.0,
    )
    assert trainer.model.frozen_names == ()  # the policy alone: no reference model
    first = seen.steps[0]
    # Step 0: -log sigmoid(beta (c - r) - gamma) per pair, the log-probs means per token.
    assert "nll_loss_sum" not in first
    assert seen.steps[-1]["loss_sum"] < first["loss_sum"]
    assert out.metrics["eval/rewards/accuracies"] > 0.5


@pytest.fixture(scope="module")
def kto(tokenizer, tmp_path_factory):
    return run(
        KTOTrainer,
        KTOArguments,
        tmp_path_factory.mktemp("kto"),
        tokenizer,
        undesirable_weight=1.5,
        beta=0.5,
    )


def test_kto_starts_at_half_the_weights_with_the_reference_a_copy(kto):
    """The reference is the start: every log ratio and the KL estimate are 0, so each loss is
    its weight x (1 - sigmoid(0)) = weight / 2; the preference pairs were unpaired into one
    desirable and one undesirable example each."""
    trainer, out, seen = kto
    first = seen.steps[0]
    assert first["tokens"] == 8  # examples
    assert first["rewards/chosen_count"] + first["rewards/rejected_count"] == 8
    expected = 0.5 * (first["rewards/chosen_count"] + 1.5 * first["rewards/rejected_count"])
    assert first["loss_sum"] == pytest.approx(expected, abs=1e-6)
    assert first["kl_sum"] == pytest.approx(0.0, abs=1e-6)
    assert first["rewards/chosen_sum"] == pytest.approx(0.0, abs=1e-6)
    assert len(trainer.dataset_train) == 32  # 16 pairs -> 32 examples


def test_kto_learns_and_logs_rewards_per_example_of_their_kind(kto):
    trainer, out, seen = kto
    # Before training every eval example's loss is its weight / 2, (0.5 + 0.75) / 2 over the
    # balanced (unpaired) eval set; a step's loss depends on its mix of kinds.
    assert out.metrics["eval/loss"] < 0.625 - 0.05
    assert out.metrics["eval/rewards/chosen"] > out.metrics["eval/rewards/rejected"]
    assert out.metrics["eval/kl"] >= 0 and out.metrics["eval/entropy"] > 0
    last = [entry for entry in logs_of(trainer) if "rewards/chosen" in entry][-1]
    # rewards/chosen is the window's sum over desirable examples / their count (not / all
    # examples): the logging window is the whole run here.
    window = {k: sum(s[k] for s in seen.steps) for k in seen.steps[0]}
    assert last["rewards/chosen"] == pytest.approx(
        window["rewards/chosen_sum"] / window["rewards/chosen_count"], rel=1e-5
    )
    assert last["loss"] == pytest.approx(window["loss_sum"] / window["tokens"], rel=1e-5)


def test_kto_reads_unpaired_rows_and_names_a_bad_label(tokenizer, tmp_path):
    rows = [
        {"prompt": f"what is {i} + 1 ?", "completion": f"{i + 1}", "label": i % 3 != 0}
        for i in range(8)
    ]
    trainer, _, seen = run(KTOTrainer, KTOArguments, tmp_path, tokenizer, steps=1, rows=rows)
    assert seen.steps[0]["rewards/chosen_count"] + seen.steps[0]["rewards/rejected_count"] == 8
    bad = [{**r, "label": "yes"} for r in rows]
    with pytest.raises(DatasetError, match=r"row \d+: column 'label' must be True/False"):
        run(KTOTrainer, KTOArguments, tmp_path / "bad", tokenizer, steps=1, rows=bad)
    missing = [{"prompt": r["prompt"], "completion": r["completion"]} for r in rows]
    with pytest.raises(DatasetError, match="no column 'label'"):
        run(KTOTrainer, KTOArguments, tmp_path / "missing", tokenizer, steps=1, rows=missing)


def test_bad_arguments_name_the_field():
    with pytest.raises(ArgumentError, match="KTOArguments.loss_type='bco'"):
        KTOArguments(loss_type="bco")
    with pytest.raises(ArgumentError, match="KTOArguments.desirable_weight"):
        KTOArguments(desirable_weight=0)
    with pytest.raises(ArgumentError, match="ORPOArguments.beta must be > 0"):
        ORPOArguments(beta=0)
    with pytest.raises(ArgumentError, match="CPOArguments.label_smoothing applies"):
        CPOArguments(loss_type="hinge", label_smoothing=0.1)
    with pytest.raises(ArgumentError, match="CPOArguments.cpo_alpha must be >= 0"):
        CPOArguments(cpo_alpha=-1)


def test_orpo_with_lora_trains_the_adapters_only(tokenizer, tmp_path):
    model = tiny_model()
    base = {k: np.asarray(v) for k, v in _kernels(model).items()}
    seen = StepMetrics()
    args = tiny_arguments(ORPOArguments, tmp_path, max_steps=3, lora_rank=4)
    trainer = ORPOTrainer(
        arguments=args,
        model=model,
        dataset_train=addition_pairs(16),
        processing_class=tokenizer,
        callbacks=[seen],
    )
    out = trainer.train()
    after = trainer.model_from_state(out.state)
    for name, kernel in _kernels(after).items():
        np.testing.assert_array_equal(np.asarray(kernel), base[name], err_msg=name)
    assert seen.steps[-1]["loss_sum"] < seen.steps[0]["loss_sum"]
    assert trainer.num_parameters < sum(x.size for x in base.values())


def _kernels(model) -> dict[str, jax.Array]:
    from flax import nnx

    return {
        "/".join(map(str, path)): v[...]
        for path, v in nnx.to_flat_state(nnx.state(model))
        if path[-1] in ("kernel", "embedding")
    }


class StopAt:
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, trainer, state, metrics, step) -> None:
        if step == self.step:
            trainer.should_stop = True


@pytest.mark.parametrize(
    "cls, args_cls", [(KTOTrainer, KTOArguments), (ORPOTrainer, ORPOArguments)]
)
def test_a_resumed_run_is_bit_exact(tokenizer, tmp_path, cls, args_cls):
    """Stopped at step 2 (a checkpoint) and resumed: the parameters of step 4 are the
    uninterrupted run's, bit for bit (the data position, the reference, the KL rows)."""

    def train(out_dir, stop=None):
        args = tiny_arguments(args_cls, None, output_dir=str(out_dir), max_steps=4, save_final=True)
        trainer = cls(
            arguments=args,
            model=tiny_model(),
            dataset_train=addition_pairs(16),
            processing_class=tokenizer,
            callbacks=[StopAt(stop)] if stop else [],
        )
        return trainer.train()

    whole = train(tmp_path / "whole").state
    assert int(train(tmp_path / "split", stop=2).state.step) == 2
    resumed = train(tmp_path / "split").state
    assert int(resumed.step) == 4
    for a, b in zip(jax.tree.leaves(whole.params), jax.tree.leaves(resumed.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_run_resumes_under_its_own_task_only(tokenizer, tmp_path):
    """An ORPO run once resumed a CPO run's checkpoint in silence (the same model class and
    config, and the checkpoint did not say which task wrote it): its log mixed the two losses.
    A subclass of the task's trainer is the same task; another task is refused, and so is
    loading the checkpoint into the other task's trainer."""
    from jaxtrain.checkpointing import CheckpointError

    class MyCPOTrainer(CPOTrainer):
        pass

    def trainer(cls, args_cls, steps):
        args = tiny_arguments(
            args_cls, None, output_dir=str(tmp_path), max_steps=steps, save_final=True
        )
        return cls(arguments=args, model=tiny_model(), dataset_train=addition_pairs(16),
                   processing_class=tokenizer)  # fmt: skip

    trainer(CPOTrainer, CPOArguments, 2).train()
    orpo = trainer(ORPOTrainer, ORPOArguments, 4)
    with pytest.raises(
        CheckpointError, match="written by CPOTrainer, and this run.s trainer is ORPOTrainer"
    ):
        orpo.train()
    with pytest.raises(CheckpointError, match="Load it with CPOTrainer"):
        orpo.load_checkpoint(tmp_path)
    assert int(trainer(MyCPOTrainer, CPOArguments, 3).train().state.step) == 3
