"""The objective contract (jaxtrain/objective.py): what a loss returns and how it is logged."""

import math

import jax.numpy as jnp
import pytest
from tiny_run import tiny_arguments, tiny_model, token_dataset

from jaxtrain import Trainer
from jaxtrain.errors import ObjectiveError
from jaxtrain.objective import check_loss_sums, summarize_sums
from jaxtrain.observability.logs import read_jsonl
from jaxtrain.training.step import causal_lm_sums

S = jnp.float32(1.0)


def test_missing_key_is_named():
    with pytest.raises(ObjectiveError, match=r"without \['tokens'\]"):
        check_loss_sums({"loss_sum": S})
    with pytest.raises(ObjectiveError, match="returned float"):
        check_loss_sums(1.0)


def test_values_must_be_scalar_sums():
    with pytest.raises(ObjectiveError, match=r"'margin_sum' with shape \(4,\)"):
        check_loss_sums({"loss_sum": S, "tokens": S, "margin_sum": jnp.ones(4)})


def test_names_the_step_or_the_logs_own_are_refused():
    with pytest.raises(ObjectiveError, match="grad_norm"):
        check_loss_sums({"loss_sum": S, "tokens": S, "grad_norm": S})
    with pytest.raises(ObjectiveError, match="'perplexity'"):
        check_loss_sums({"loss_sum": S, "tokens": S, "perplexity_sum": S})


def test_the_logging_rule():
    # Every key is a per-unit mean over `tokens` (a trailing _sum dropped), correct is
    # accuracy; the same with the eval/ prefix.
    totals = {"loss_sum": 8.0, "tokens": 4.0, "correct": 1.0, "margin_sum": 2.0, "kl/t": 3.0}
    logs = summarize_sums(totals, prefix="eval/")
    assert logs["eval/loss"] == 2.0 and logs["eval/accuracy"] == 0.25
    assert logs["eval/margin"] == 0.5 and logs["eval/kl/t"] == 0.75
    assert logs["eval/perplexity"] == pytest.approx(math.exp(2.0))
    assert "accuracy" not in summarize_sums({"loss_sum": 1.0, "tokens": 1.0})
    # A loss that is not a token NLL (a preference loss) has no perplexity.
    assert "eval/perplexity" not in summarize_sums(totals, prefix="eval/", perplexity=False)


class MinimalObjective(Trainer):
    """Only the two required sums (the docstring's promise): no `correct`."""

    def compute_loss_sums(self, model, batch, rng):
        sums = causal_lm_sums(model(batch["input_ids"]), batch["labels"])
        return {"loss_sum": sums["loss_sum"], "tokens": sums["tokens"]}


class ExtraSums(Trainer):
    """Extra per-token sums, as a task objective would add: a z-loss, and half the token
    count (whose logged per-token mean must be exactly 0.5 over any window)."""

    def compute_loss_sums(self, model, batch, rng):
        logits = model(batch["input_ids"])
        sums = causal_lm_sums(logits, batch["labels"])
        mask = (batch["labels"][:, 1:] != -100).astype(jnp.float32)
        log_z = jnp.log(jnp.exp(logits[:, :-1].astype(jnp.float32)).sum(-1))
        sums["z_loss_sum"] = (log_z**2 * mask).sum()
        sums["half_sum"] = 0.5 * sums["tokens"]
        return sums


def _run(cls, tmp_path, **overrides):
    args = tiny_arguments(
        str(tmp_path / "run"), max_steps=4, logging_steps=2, eval_steps=4, **overrides
    )
    trainer = cls(
        arguments=args,
        model=tiny_model(),
        dataset_train=token_dataset(),
        dataset_eval=token_dataset(rows=16, seed=1),
    )
    output = trainer.train()
    return output, read_jsonl(tmp_path / "run" / "metrics.jsonl")


def test_an_objective_with_only_the_required_sums_trains_and_logs(tmp_path):
    output, records = _run(MinimalObjective, tmp_path)
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [2, 4]
    assert all(r["loss"] > 0 and "accuracy" not in r for r in train)
    assert output.metrics["eval/loss"] > 0 and "eval/accuracy" not in output.metrics


def test_extra_sums_reach_metrics_jsonl_and_eval(tmp_path):
    output, records = _run(ExtraSums, tmp_path)
    train = [r for r in records if "loss" in r]
    # Summed over micro-batches and steps, divided by the summed tokens: exactly 0.5.
    assert [r["half"] for r in train] == [0.5, 0.5]
    assert all(r["z_loss"] > 0 and 0 <= r["accuracy"] <= 1 for r in train)
    evals = [r for r in records if "eval/loss" in r]
    assert evals and evals[-1]["eval/z_loss"] > 0 and evals[-1]["eval/half"] == 0.5


def test_a_broken_objective_fails_before_the_first_step(tmp_path):
    class NoTokens(Trainer):
        def compute_loss_sums(self, model, batch, rng):
            return {
                "loss_sum": causal_lm_sums(model(batch["input_ids"]), batch["labels"])["loss_sum"]
            }

    with pytest.raises(ObjectiveError, match="tokens"):
        _run(NoTokens, tmp_path)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_sum_with_its_own_count_is_averaged_over_that_count():
    """GRPO logs token means (KL over completion tokens) beside a per-completion loss."""
    totals = {"loss_sum": 6.0, "tokens": 3.0, "kl_sum": 2.0, "kl_count": 8.0, "z_sum": 9.0}
    logs = summarize_sums(totals, perplexity=False)
    assert logs == {"loss": 2.0, "kl": 0.25, "z": 3.0}  # the count itself is not logged
    with pytest.raises(ObjectiveError, match="'kl_count' without 'kl_sum'"):
        check_loss_sums(
            {"loss_sum": jnp.zeros(()), "tokens": jnp.ones(()), "kl_count": jnp.ones(())}
        )
