"""Training on a weighted mixture: the logged per-source shares and losses, an exact resume,
and a mixture that runs out (the loader's own tests are tests/data/test_mixture.py)."""

from __future__ import annotations

import datasets
import jax
import numpy as np
from tiny_run import SEQ, VOCAB, tiny_arguments, tiny_model

from jaxtrain import Trainer
from jaxtrain.checkpointing import read_metadata
from jaxtrain.data import Source, build_mixture_loader
from jaxtrain.observability.logs import read_jsonl


def full_rows(n: int, seed: int) -> list[dict]:
    """Rows of exactly SEQ tokens: every row has the same number of targets."""
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(3, VOCAB, SEQ).tolist()} for _ in range(n)]


def sources() -> dict:
    # A random-access source and a stream, both smaller than the run: several epochs each.
    return {
        "web": datasets.Dataset.from_list(full_rows(24, 1)),
        "code": Source(full_rows(10, 2), streaming=True),
    }


STAGES = [[0, {"web": 0.75, "code": 0.25}], [6, {"web": 0.25, "code": 0.75}]]


class Losses:
    """Per-step losses; stops the run after `stop_at`."""

    def __init__(self, stop_at=None):
        self.losses, self.stop_at = {}, stop_at

    def on_step_end(self, trainer, state, metrics, step):
        self.losses[step] = float(metrics["loss_sum"]) / float(metrics["tokens"])
        if step == self.stop_at:
            trainer.should_stop = True


def mixture_trainer(output_dir, callback, **overrides) -> Trainer:
    arguments = tiny_arguments(
        str(output_dir), max_steps=12, logging_steps=1, mixture_weights=STAGES, **overrides
    )
    return Trainer(arguments=arguments, model=tiny_model(), dataset_train=sources(),
                   callbacks=[callback])  # fmt: skip


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_a_resumed_mixture_is_bit_identical_and_logs_each_source(tmp_path):
    straight = Losses()
    expected = mixture_trainer(tmp_path / "straight", straight).train()

    # The logged shares are the stage's weights (full rows: a share of rows is of tokens),
    # switching at step 7 (the stage starting at step index 6); epochs grow per source.
    logs = [r for r in read_jsonl(tmp_path / "straight" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in logs] == list(range(1, 13))
    for record in logs:
        web = 0.75 if record["step"] <= 6 else 0.25
        assert record["mixture/web/share"] == web
        assert record["mixture/code/share"] == 1 - web
        assert record["mixture/web/loss"] > 0 and record["mixture/code/loss"] > 0
    last = logs[-1]
    # 12 steps x 8 rows: web 6 x 6 + 6 x 2 = 48 rows of its 24; code 48 rows of its 10
    # (a stream of unknown length counts whole epochs: 4 of them done).
    assert last["mixture/web/epoch"] == 2.0 and last["mixture/code/epoch"] == 4.0
    assert last["mixture/web/tokens"] == 48 * (SEQ - 1)
    assert last["mixture/code/tokens"] == 48 * (SEQ - 1)

    first_half = Losses(stop_at=5)
    stopped = mixture_trainer(tmp_path / "resumed", first_half).train()
    assert stopped.stop_reason == "callback" and int(stopped.state.step) == 5
    second_half = Losses()
    resumed = mixture_trainer(tmp_path / "resumed", second_half).train()
    assert sorted(second_half.losses) == list(range(6, 13))
    assert {**first_half.losses, **second_half.losses} == straight.losses
    for a, b in zip(leaves(expected.state), leaves(resumed.state), strict=True):
        np.testing.assert_array_equal(a, b)
    resumed_logs = [r for r in read_jsonl(tmp_path / "resumed" / "metrics.jsonl") if "loss" in r]
    assert resumed_logs[-1]["mixture/code/tokens"] == last["mixture/code/tokens"]
    assert read_metadata(resumed.checkpoint_path)["data_state"]["kind"] == "mixture"


def test_each_source_s_logged_loss_is_its_rows_evaluated_alone(tmp_path):
    """The first step's per-source loss (initial parameters) equals an evaluation of the
    same parameters on that source's rows of the step, source by source."""
    arguments = tiny_arguments(
        str(tmp_path / "run"), max_steps=1, warmup_steps=0, logging_steps=1,
        mixture_weights=STAGES,
    )  # fmt: skip
    (batch,) = [next(build_mixture_loader(arguments, sources()).batches())]
    rows = {
        name: [{"input_ids": r.tolist()} for r in batch["input_ids"][batch["source_ids"] == k]]
        for k, name in enumerate(("web", "code"))
    }
    assert len(rows["web"]) == 6 and len(rows["code"]) == 2
    trainer = Trainer(arguments=arguments, model=tiny_model(), dataset_train=sources())
    initial = trainer.create_state()
    trainer.train()
    (logged,) = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    for name, source_rows in rows.items():
        alone = Trainer(
            arguments=tiny_arguments(str(tmp_path / name), eval_batch_size=2),
            model=tiny_model(),
            dataset_eval=source_rows,
        )
        evaluated = alone.evaluate(initial)
        np.testing.assert_allclose(
            logged[f"mixture/{name}/loss"], evaluated["eval/loss"], rtol=1e-6
        )
    # The whole step's loss is the token-weighted mean of the sources' (6 and 2 full rows).
    mean = (6 * logged["mixture/web/loss"] + 2 * logged["mixture/code/loss"]) / 8
    np.testing.assert_allclose(logged["loss"], mean, rtol=1e-6)


def test_a_mixture_that_runs_out_ends_the_run_and_stays_ended(tmp_path):
    small = {"web": full_rows(40, 1), "code": full_rows(8, 2)}  # code: 2 rows a step, 4 steps
    arguments = dict(max_steps=12, mixture_weights={"web": 0.75, "code": 0.25},
                     mixture_exhausted="stop", save_steps=2)  # fmt: skip
    run = tmp_path / "run"
    trainer = Trainer(arguments=tiny_arguments(str(run), **arguments), model=tiny_model(),
                      dataset_train=small)  # fmt: skip
    out = trainer.train()
    assert out.stop_reason == "data_exhausted" and int(out.state.step) == 4
    assert read_metadata(out.checkpoint_path)["data_state"]["step"] == 4
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r] == [2, 4]
    again = Trainer(arguments=tiny_arguments(str(run), **arguments), model=tiny_model(),
                    dataset_train=small).train()  # fmt: skip
    assert again.stop_reason == "data_exhausted" and int(again.state.step) == 4
