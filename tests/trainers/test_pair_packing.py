"""Padding-free preference batches (`packing=True`) equal padded ones: the same pairs packed
into shared rows give the same per-pair log-probs, loss and gradient for DPO, ORPO, SimPO,
the reward model and KTO (its rotated KL sequences too), a pair longer than half a row
included; and a packed run trains, varies its pairs per step and resumes exactly."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from trainer_fixtures import StepMetrics, addition_pairs, tiny_arguments, tiny_model

from jaxtrain.config.sections import RunSettings
from jaxtrain.data.unit_packing import RowSpace, pack_units
from jaxtrain.trainers import (
    CPOArguments,
    DPOArguments,
    DPOTrainer,
    KTOArguments,
    KTOTrainer,
    ORPOArguments,
)
from jaxtrain.trainers.cpo import cpo_objective
from jaxtrain.trainers.data import PairCollator, PairFeaturizer
from jaxtrain.trainers.dpo import dpo_objective, pair_logps
from jaxtrain.trainers.frozen import TaskModel
from jaxtrain.trainers.kto import kto_objective
from jaxtrain.trainers.kto_data import KTOCollator, KTOFeaturizer
from jaxtrain.trainers.orpo import orpo_objective
from jaxtrain.trainers.packed import KTOLayout, PairLayout, units_per_micro_batch
from jaxtrain.trainers.reward import REWARD_OBJECTIVE, RewardModel

L = 24  # tokens per row


class Stream:
    """A peekable list of examples (what the loader hands pack_units), then one that never
    fits (so the micro-batch closes with every example of the list in it)."""

    def __init__(self, examples):
        self.examples, self.at = list(examples), 0
        never = np.zeros(L + 1, np.int64)
        self.end = {k: never for k in ("chosen_input_ids", "chosen_labels", "rejected_input_ids")}
        self.end.update(rejected_labels=never, prompt_ids=never, completion_ids=never)

    def peek(self):
        return self.examples[self.at] if self.at < len(self.examples) else self.end

    def take(self):
        self.at += 1


def pairs_with_a_long_one(n: int = 6) -> list[dict[str, str]]:
    rows = addition_pairs(n)
    for i, row in enumerate(rows):
        row["rejected"] = " ".join([row["rejected"]] * (1 + i % 3))
    # Prompt + chosen and prompt + rejected of 14 and 16 tokens: 30 > L, over half a row each.
    rows[2] = {
        "prompt": "what is 1 + 2 + 3 + 4 ?",
        "chosen": "10 10 10",
        "rejected": "11 11 11 11 11",
    }
    return rows


@pytest.fixture(scope="module")
def pair_examples(tokenizer):
    rows = pairs_with_a_long_one()
    featurizer = PairFeaturizer(name="pairs", tokenizer=tokenizer, max_length=L)
    featurizer.detect(rows[0])
    examples = featurizer(rows, range(len(rows)))
    long = examples[2]
    assert len(long["chosen_input_ids"]) > L // 2 and len(long["rejected_input_ids"]) > L // 2
    return examples


@pytest.fixture(scope="module")
def batches(pair_examples, tokenizer):
    """The same pairs padded (one sequence per row: 12 rows) and packed into 7 rows."""
    padded = PairCollator(L, tokenizer.pad_token_id)(pair_examples)
    rows = 7
    packed, stats = pack_units(
        Stream(pair_examples),
        PairLayout(),
        rows=rows,
        seq_len=L,
        capacity=units_per_micro_batch(rows, L),
        pad_token_id=0,
    )
    n = len(pair_examples)
    assert packed["pair_mask"][:n].all() and not packed["pair_mask"][n:].any()  # all packed
    assert stats.num_padding_tokens < padded["attention_mask"].size - padded["attention_mask"].sum()
    return padded, packed


def test_the_long_pair_s_sequences_sit_in_two_rows_each_numbered_from_zero(batches):
    _, packed = batches
    n = int(packed["pair_mask"].sum())
    capacity = packed["pair_mask"].shape[0]
    rows_of = {
        side: np.nonzero((packed["sequence_index"] == side * capacity + 2).any(1))[0]
        for side in (0, 1)
    }
    assert len(rows_of[0]) == len(rows_of[1]) == 1 and rows_of[0][0] != rows_of[1][0]
    for s in [k * capacity + u for k in (0, 1) for u in range(n)]:
        where = (packed["sequence_index"] == s) & (packed["segment_ids"] > 0)
        row = np.nonzero(where.any(1))[0][0]
        span = np.nonzero(where[row])[0]
        assert (packed["positions"][row, span] == np.arange(len(span))).all()
        assert packed["labels"][row, span[0]] == -100  # not predicted from the previous one
        assert len(set(packed["segment_ids"][row, span])) == 1


def test_best_fit_takes_the_fullest_row_that_fits():
    space = RowSpace(3, 10)
    assert space.fit([6, 7, 3]) == [0, 1, 1]  # 3 goes where 3 is left, not to the empty row
    assert space.fit([5]) == [2] and space.fit([6]) is None and space.free == [4, 0, 5]


def jax_terms(objective, task_model, batch):
    """(objective sums, its gradient) of `batch` as one global batch of one micro-batch."""
    graphdef, params, rest = nnx.split(task_model, nnx.Param, ...)
    micro = {k: jnp.asarray(v) for k, v in batch.items()}
    global_batch = {k: v[None] for k, v in micro.items()}
    normalizer = jnp.maximum(objective.normalizer(global_batch), 1.0)
    if objective.global_scalars is not None:
        micro = {**micro, **objective.global_scalars(global_batch)}

    def loss(params):
        sums = objective.loss_sums(nnx.merge(graphdef, params, rest), micro, jax.random.key(0))
        return sums["loss_sum"] / normalizer, sums

    grads, sums = jax.jit(jax.grad(loss, has_aux=True))(params)
    return {k: float(v) for k, v in sums.items()}, grads


def assert_equal_terms(padded_terms, packed_terms):
    (sums_a, grads_a), (sums_b, grads_b) = padded_terms, packed_terms
    assert sums_a.keys() == sums_b.keys()
    # Sums of differences of log-probs near -20 (a margin of 4e-4 is a cancellation): an
    # absolute tolerance at float32's resolution of the log-probs themselves.
    for key in sums_a:
        np.testing.assert_allclose(sums_b[key], sums_a[key], rtol=1e-6, atol=1e-5, err_msg=key)
    for a, b in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7)


def test_per_pair_log_probs_equal_the_padded_batch_s(batches):
    padded, packed = batches
    model = tiny_model()
    n = padded["input_ids"].shape[0]
    logps = jax.jit(pair_logps)
    ours = logps(model, {k: jnp.asarray(v) for k, v in padded.items()})
    theirs = logps(model, {k: jnp.asarray(v) for k, v in packed.items()})
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(np.asarray(b)[:n], np.asarray(a), rtol=1e-6)


def test_dpo_loss_and_gradient_equal_the_padded_batch_s(batches):
    padded, packed = batches
    model = TaskModel(tiny_model(), reference=tiny_model(seed=1))
    objective = dpo_objective(RunSettings.from_arguments(DPOArguments(beta=0.5)))
    assert_equal_terms(jax_terms(objective, model, padded), jax_terms(objective, model, packed))


@pytest.mark.parametrize(
    "objective",
    [
        orpo_objective(RunSettings.from_arguments(ORPOArguments(beta=0.3))),
        cpo_objective(
            RunSettings.from_arguments(
                CPOArguments(loss_type="simpo", cpo_alpha=0.5, simpo_gamma=0.4)
            )
        ),
    ],
    ids=["orpo", "cpo_simpo"],
)
def test_reference_free_losses_equal_the_padded_batch_s(batches, objective):
    """ORPO's NLL covers prompts too (its token count from the packed segments); SimPO's
    log-probs are per-token means."""
    padded, packed = batches
    model = TaskModel(tiny_model())
    assert_equal_terms(jax_terms(objective, model, padded), jax_terms(objective, model, packed))


def test_reward_scores_equal_the_padded_batch_s(batches):
    padded, packed = batches
    model = TaskModel(RewardModel(tiny_model()))
    sums_a, grads_a = jax_terms(REWARD_OBJECTIVE, model, padded)
    sums_b, grads_b = jax_terms(REWARD_OBJECTIVE, model, packed)
    assert_equal_terms((sums_a, grads_a), (sums_b, grads_b))


def test_kto_with_its_rotated_kl_sequences_equals_the_padded_batch(tokenizer):
    rows = [
        {"prompt": r["prompt"], "completion": r["chosen"], "label": i % 3 != 1}
        for i, r in enumerate(pairs_with_a_long_one())
    ]
    featurizer = KTOFeaturizer(name="kto", tokenizer=tokenizer, max_length=L)
    featurizer.detect(rows[0])
    examples = featurizer(rows, range(len(rows)))
    padded = KTOCollator(L, tokenizer.pad_token_id, group=len(rows))(examples)
    rows_per_batch = 7
    packed, _ = pack_units(
        Stream(examples),
        KTOLayout(L, kl=True),
        rows=rows_per_batch,
        seq_len=L,
        capacity=units_per_micro_batch(rows_per_batch, L),
        pad_token_id=0,
    )
    assert packed["pair_mask"].sum() == len(rows)
    # A sharp reference gives the mismatched completions lower log-probs than the near-uniform
    # policy does: the KL estimate is positive, not clamped to 0.
    model = TaskModel(tiny_model(), reference=tiny_model(seed=1, initializer_range=0.5))
    objective = kto_objective(
        RunSettings.from_arguments(KTOArguments(beta=0.5, undesirable_weight=1.3))
    )
    padded_terms = jax_terms(objective, model, padded)
    assert padded_terms[0]["kl_sum"] > 0
    assert_equal_terms(padded_terms, jax_terms(objective, model, packed))


# ------------------------------------------------------------------------------- a packed run
def train_dpo(tokenizer, out_dir, *, packing, stop=None, steps=4):
    seen = StepMetrics()

    class StopAt:
        def on_step_end(self, trainer, state, metrics, step):
            if step == stop:
                trainer.should_stop = True

    args = tiny_arguments(
        DPOArguments,
        None,
        output_dir=str(out_dir),
        max_steps=steps,
        packing=packing,
        total_batch_size=4,
        gradient_accumulation_steps=2,
        save_final=True,
    )
    trainer = DPOTrainer(
        arguments=args,
        model=tiny_model(),
        dataset_train=addition_pairs(64),
        processing_class=tokenizer,
        callbacks=[seen, StopAt()],
    )
    return trainer.train(), seen


def test_a_packed_dpo_run_holds_more_pairs_per_row_and_resumes_exactly(tokenizer, tmp_path):
    whole, seen = train_dpo(tokenizer, tmp_path / "whole", packing=True)
    # 4 rows of 16 tokens per step (2 micro-batches of 2) hold more than 2 pairs (the padded
    # batch's 4 rows hold 2: chosen and rejected each fill one); step 0 is still ln 2.
    pairs = [s["tokens"] for s in seen.steps]
    assert min(pairs) > 2
    assert seen.steps[0]["loss_sum"] / pairs[0] == pytest.approx(np.log(2), abs=1e-6)
    stopped, _ = train_dpo(tokenizer, tmp_path / "split", packing=True, stop=2)
    assert int(stopped.state.step) == 2
    resumed, rest = train_dpo(tokenizer, tmp_path / "split", packing=True)
    assert [s["tokens"] for s in rest.steps] == pairs[2:]  # the same pairs, from the position
    for a, b in zip(jax.tree.leaves(whole.state.params), jax.tree.leaves(resumed.state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_packed_kto_run_trains(tokenizer, tmp_path):
    seen = StepMetrics()
    args = tiny_arguments(
        KTOArguments,
        tmp_path,
        max_steps=2,
        packing=True,
        total_batch_size=4,
        max_sequence_length=32,
    )
    KTOTrainer(
        arguments=args,
        model=tiny_model(),
        dataset_train=addition_pairs(32),
        processing_class=tokenizer,
        callbacks=[seen],
    ).train()
    first = seen.steps[0]
    # An example and its KL sequence are 16 tokens: 4 rows of 32 hold 8 (padded: 4 rows and
    # their 4 KL rows hold 4).
    assert first["tokens"] == 8
    assert first["kl_sum"] == pytest.approx(0.0, abs=1e-6)  # the reference is the start
    assert first["loss_sum"] == pytest.approx(0.5 * first["tokens"], abs=1e-5)


def test_orpo_kto_and_packed_dpo_on_a_mesh_train_like_one_device(tmp_path):
    """dp2 x fsdp2 x tp2 on 8 CPU devices: the losses of one device (ORPO's global token
    count, KTO's KL estimate, packed pairs split over devices)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    worker = Path(__file__).with_name("preference_mesh_worker.py")
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, str(worker), str(out)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for run, losses in json.loads(out.read_text()).items():
        np.testing.assert_allclose(
            losses["dp2_fsdp2_tp2"], losses["single"], rtol=2e-4, err_msg=run
        )
