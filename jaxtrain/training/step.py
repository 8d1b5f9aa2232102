"""Pure train and eval steps. Everything here runs inside `jax.jit`.

Loss normalisation is token-weighted: the loss of an update is the sum of per-token losses
over every micro-batch divided by the number of target tokens of the whole global batch.
The mean of per-micro-batch means, which peers use, weights a token of a short (heavily
padded) micro-batch more than a token of a long one; this never does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxtrain.data.collate import IGNORE_INDEX
from jaxtrain.models.attention import padding_segments
from jaxtrain.objective import Objective, check_loss_sums
from jaxtrain.state import TrainState
from jaxtrain.training.logps import (
    chunk_tokens_for,
    chunked_logp_sums,
    chunks_logits,
    next_token_targets,
    target_logps,
)
from jaxtrain.training.optim import TunableOptimizer

# (model, batch, rng) -> dict of sums over the batch: the contract is in objective.py.
LossSumsFn = Objective
# global batch -> named scalars every micro-batch's objective reads (a token count that a
# per-pair loss divides a token sum by: ORPO's and CPO's NLL term).
GlobalScalarsFn = Callable[[dict[str, jax.Array]], dict[str, jax.Array]]


def with_global_scalars(
    micro_batch: dict[str, jax.Array], scalars: dict[str, jax.Array]
) -> dict[str, jax.Array]:
    """`micro_batch` with the global batch's scalars added (a name clash is an error: the
    objective would read the wrong value silently)."""
    clash = sorted(set(micro_batch) & set(scalars))
    if clash:
        raise ValueError(f"global scalars {clash} clash with batch keys of the same name")
    return {**micro_batch, **scalars}


def causal_lm_sums(logits: jax.Array, labels: jax.Array) -> dict[str, jax.Array]:
    """Sums of next-token cross-entropy and accuracy; labels are aligned with the inputs.

    logits[:, t] predicts labels[:, t + 1]; positions labelled IGNORE_INDEX do not count.
    The log-probs are ``logps.target_logps``'s.
    """
    return causal_lm_rows(logits, labels)[0]


def causal_lm_rows(
    logits: jax.Array, labels: jax.Array
) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """``causal_lm_sums`` and each row's {"nll", "tokens"} [B] (without gradient)."""
    logp_BxT, mask_BxT, top_BxT = target_logps(logits, next_token_targets(labels))
    sums = {
        "loss_sum": -logp_BxT.sum(),
        "correct": top_BxT.sum().astype(jnp.float32),
        "tokens": mask_BxT.sum().astype(jnp.float32),
    }
    rows = {"nll": -logp_BxT.sum(-1), "tokens": mask_BxT.sum(-1).astype(jnp.float32)}
    return sums, jax.lax.stop_gradient(rows)


def chunked_causal_lm_sums(
    hidden: jax.Array,
    project: Callable[[jax.Array], jax.Array],
    labels: jax.Array,
    *,
    chunk_tokens: int,
) -> dict[str, jax.Array]:
    """``causal_lm_sums`` from hidden states [B, T, D], ``chunk_tokens`` positions at a time
    (``logps.chunked_logp_sums``: no [B, T, V] logits, the gradient formed in the forward)."""
    sums = chunked_logp_sums(hidden, project, labels, chunk_tokens=chunk_tokens)
    return {"loss_sum": -sums["logp_sum"], "correct": sums["top"], "tokens": sums["tokens"]}


def causal_lm_loss_sums(model: nnx.Module, batch: dict[str, jax.Array], rng: jax.Array):
    """Default loss of the Trainer: a causal LM called as model(input_ids, ...) -> logits.

    Models for which ``logps.chunks_logits`` holds (the Llama family, a vocabulary of at
    least CHUNKED_LOSS_MIN_VOCAB or long rows) get the chunked loss (same sums).
    Models with ``returns_aux_losses`` (mixture-of-experts) also return their auxiliary
    losses; see ``add_aux_losses``.
    """
    return causal_lm_loss_rows(model, batch, rng)[0]


def model_segment_ids(batch: dict[str, jax.Array]) -> jax.Array | None:
    """The segment ids a model call on `batch`'s rows takes: a packed batch's own; for padded
    rows, those marking the padding after each row's last token where blockwise attention
    then skips it (`attention.padding_segments`), else None."""
    segment_ids = batch.get("segment_ids")
    return padding_segments(batch.get("attention_mask")) if segment_ids is None else segment_ids


def causal_lm_loss_rows(
    model: nnx.Module, batch: dict[str, jax.Array], rng: jax.Array
) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """``causal_lm_loss_sums`` and each row's cross-entropy sum and target tokens
    ({"nll", "tokens"} [B], no gradient): what a mixture's per-source loss is made of."""
    del rng  # the Llama family has no dropout; custom losses may use it
    kwargs: dict[str, Any] = dict(
        positions=batch.get("positions"), segment_ids=model_segment_ids(batch)
    )
    if "pixel_values" in batch:  # a vision-language model's images (data/vision.py)
        kwargs["pixel_values"] = batch["pixel_values"]
    with_aux = bool(getattr(model, "returns_aux_losses", False))
    if with_aux:
        kwargs["return_aux"] = True
    if chunks_logits(model, batch["input_ids"].size):
        out = model.hidden_states(batch["input_ids"], **kwargs)
        hidden, aux = out if with_aux else (out, None)
        chunk = chunk_tokens_for(model.config.vocab_size)
        sums = chunked_logp_sums(
            hidden, model.output_projection(), batch["labels"], chunk_tokens=chunk
        )
        rows = jax.lax.stop_gradient({"nll": -sums["row_logp"], "tokens": sums["row_tokens"]})
        sums = {"loss_sum": -sums["logp_sum"], "correct": sums["top"], "tokens": sums["tokens"]}
    else:
        out = model(batch["input_ids"], **kwargs)
        logits, aux = out if with_aux else (out, None)
        sums, rows = causal_lm_rows(logits, batch["labels"])
    return (sums if aux is None else add_aux_losses(sums, aux)), rows


def add_aux_losses(sums: dict[str, jax.Array], aux: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Fold a model's auxiliary losses (per-token means) into the loss sums.

    ``aux["aux_loss"]`` (already weighted by its coefficients) is added to the loss
    once per target token, so the step's loss is mean cross-entropy + aux loss; every aux
    value is also returned as ``<name>_sum`` (times the tokens) for the metrics, which
    divide sums by tokens like the loss.
    """
    tokens = sums["tokens"]
    out = dict(sums)
    out["loss_sum"] = sums["loss_sum"] + tokens * aux["aux_loss"].astype(jnp.float32)
    for name, value in aux.items():
        out[f"{name}_sum"] = tokens * value.astype(jnp.float32)
    return out


def count_target_tokens(batch: dict[str, jax.Array]) -> jax.Array:
    """Number of tokens that carry a loss in a (possibly [A, M, T]) causal LM batch."""
    return (batch["labels"][..., 1:] != IGNORE_INDEX).sum().astype(jnp.float32)


def make_train_step(
    *,
    graphdef: nnx.GraphDef,
    rest: nnx.State | None = None,
    optimizer: optax.GradientTransformation | TunableOptimizer,
    schedule: optax.Schedule | None = None,
    seed: int,
    loss_sums_fn: LossSumsFn = causal_lm_loss_sums,
    normalizer_fn: Callable[[dict[str, jax.Array]], jax.Array] = count_target_tokens,
    state_metrics: Callable[[TrainState], dict[str, jax.Array]] | None = None,
    global_scalars_fn: GlobalScalarsFn | None = None,
) -> Callable[[TrainState, dict[str, jax.Array]], tuple[TrainState, dict[str, jax.Array]]]:
    """Build `train_step(state, batch, frozen=None, numbers=None)`; batch leaves are [A, ...]
    (micro-batches).

    `optimizer`: an optax transformation and its `schedule`, or a TunableOptimizer, whose
    `numbers` (learning-rate schedule, weight decay, clipping) the step takes as an argument:
    placed like any input, not baked into the program, so one compile serves every value.
    Without them, the optimizer's own numbers are constants.

    `global_scalars_fn(global batch)`: named scalars of the whole global batch that every
    micro-batch's objective reads as `batch[name]` (with_global_scalars).

    `state_metrics(new_state)`: values of the state after the update, logged as the logging
    window's last (objective.STATE_KEYS: pruning's `sparsity`).

    `frozen` is the model's non-Param state (frozen weights such as a DPO reference, a teacher
    or LoRA's base kernels): an argument, so that it is placed on the mesh like any input and
    not baked into the compiled program as a constant. Without it, `rest` is used.
    """

    def micro_loss(params, frozen, micro_batch, rng, normalizer):
        model = nnx.merge(graphdef, params, frozen)
        sums = check_loss_sums(loss_sums_fn(model, micro_batch, rng))  # at trace time
        return sums["loss_sum"] / normalizer, sums

    grad_fn = jax.grad(micro_loss, has_aux=True)
    if not isinstance(optimizer, TunableOptimizer):
        optimizer = TunableOptimizer.fixed(optimizer, schedule)
    tunable = optimizer

    def train_step(
        state: TrainState, batch: dict[str, jax.Array], frozen: Any = None, numbers: Any = None
    ):
        frozen = rest if frozen is None else frozen
        optimizer, schedule = tunable.build(tunable.numbers if numbers is None else numbers)
        normalizer = jnp.maximum(normalizer_fn(batch), 1.0)
        scalars = {} if global_scalars_fn is None else global_scalars_fn(batch)
        step_key = jax.random.fold_in(jax.random.key(seed), state.step)
        num_micro = jax.tree.leaves(batch)[0].shape[0]

        if num_micro == 1:
            micro = with_global_scalars(jax.tree.map(lambda x: x[0], batch), scalars)
            grads, sums = grad_fn(state.params, frozen, micro, step_key, normalizer)
        else:

            def accumulate(carry, inputs):
                grads_acc, sums_acc = carry
                index, micro = inputs
                micro = with_global_scalars(micro, scalars)
                micro_key = jax.random.fold_in(step_key, index)
                grads, sums = grad_fn(state.params, frozen, micro, micro_key, normalizer)
                grads_acc = jax.tree.map(lambda a, g: a + g.astype(a.dtype), grads_acc, grads)
                sums_acc = jax.tree.map(jnp.add, sums_acc, sums)
                return (grads_acc, sums_acc), None

            first = with_global_scalars(jax.tree.map(lambda x: x[0], batch), scalars)
            grads_shape, sums_shape = jax.eval_shape(
                grad_fn, state.params, frozen, first, step_key, normalizer
            )
            grads0 = jax.tree.map(lambda g: jnp.zeros(g.shape, jnp.float32), grads_shape)
            sums0 = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), sums_shape)
            (grads, sums), _ = jax.lax.scan(
                accumulate, (grads0, sums0), (jnp.arange(num_micro), batch)
            )
            grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)

        grad_norm = optax.tree.norm(grads)
        # A NaN/Inf loss or gradient never reaches the state: the update is skipped and the
        # host decides from `nonfinite` whether to stop or go on (TrainingArguments.on_nan).
        # A cond, not a select of new or old per leaf: the select read both states and cost
        # 5% of an S2 step and 0.3-0.5 s of its compile (bench/RESULTS.md, 2026-11-24).
        finite = jnp.isfinite(sums["loss_sum"]) & jnp.isfinite(grad_norm)

        def update(params, opt_state):
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        params, opt_state = jax.lax.cond(
            finite, update, lambda *old: old, state.params, state.opt_state
        )
        # A skipped step's sums would poison the logged window average: count it as empty.
        metrics = {k: jnp.where(finite, v, jnp.zeros_like(v)) for k, v in sums.items()}
        metrics["nonfinite"] = jnp.logical_not(finite)
        metrics["grad_norm"] = grad_norm
        metrics["learning_rate"] = jnp.asarray(schedule(state.step), jnp.float32)
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        if state_metrics is not None:
            metrics.update(state_metrics(new_state))
        return new_state, metrics

    return train_step


def make_eval_step(
    *,
    graphdef: nnx.GraphDef,
    rest: nnx.State | None = None,
    loss_sums_fn: LossSumsFn = causal_lm_loss_sums,
    global_scalars_fn: GlobalScalarsFn | None = None,
) -> Callable[..., dict[str, jax.Array]]:
    """Build `eval_step(params, batch, frozen=None) -> sums`, the same reduction as training
    (an eval batch is its own global batch for `global_scalars_fn`)."""

    def eval_step(params, batch, frozen=None):
        frozen = rest if frozen is None else frozen
        model = nnx.merge(graphdef, params, frozen)
        if global_scalars_fn is not None:
            batch = with_global_scalars(batch, global_scalars_fn(batch))
        return check_loss_sums(loss_sums_fn(model, batch, jax.random.key(0)))

    return eval_step


class StepWithFrozen:
    """The compiled train step with its other inputs bound: `step(state, batch)`.
    `placed_inputs()` gives the frozen state and the optimizer's numbers on the mesh; it is
    called at the first step (a ModelFactory's frozen state exists only once the state does)."""

    def __init__(self, compiled: Any, placed_inputs: Callable[[], tuple[Any, Any]]):
        self.compiled, self._placed_inputs, self.inputs = compiled, placed_inputs, None

    def __call__(self, state: TrainState, batch: dict[str, jax.Array]):
        if self.inputs is None:
            self.inputs = self._placed_inputs()
        return self.compiled(state, batch, *self.inputs)

    def __getattr__(self, name: str) -> Any:  # compiles, lower, ... of the TrackedJit
        return getattr(self.compiled, name)
