"""Pure train and eval steps. Everything here runs inside `jax.jit`.

Loss normalisation is token-weighted: the loss of an update is the sum of per-token losses
over every micro-batch divided by the number of target tokens of the whole global batch.
The mean of per-micro-batch means, which peers use, weights a token of a short (heavily
padded) micro-batch more than a token of a long one; this never does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.custom_derivatives import SymbolicZero

from jaxtrain.data.collate import IGNORE_INDEX
from jaxtrain.objective import Objective, check_loss_sums
from jaxtrain.state import TrainState

# (model, batch, rng) -> dict of sums over the batch: the contract is in objective.py.
LossSumsFn = Objective


def causal_lm_sums(
    logits: jax.Array, labels: jax.Array, *, shifted: bool = False
) -> dict[str, jax.Array]:
    """Sums of next-token cross-entropy and accuracy; labels are aligned with the inputs.

    logits[:, t] predicts labels[:, t + 1]; positions labelled IGNORE_INDEX do not count.
    ``shifted=True``: the labels are already the targets of the logits (logits[:, t]
    predicts labels[:, t]).
    """
    logits_BxTxV, targets_BxT = logits.astype(jnp.float32), labels
    if not shifted:
        # The last position has no target: it is masked, not sliced off. Slicing [B, T, V]
        # logits costs a logits-sized copy forward and a pad of their gradient backward.
        ignore = jnp.full_like(labels[:, :1], IGNORE_INDEX)
        targets_BxT = jnp.concatenate([labels[:, 1:], ignore], axis=1)
    mask_BxT = targets_BxT != IGNORE_INDEX
    safe_targets = jnp.where(mask_BxT, targets_BxT, 0)
    log_norm = jax.nn.logsumexp(logits_BxTxV, axis=-1)
    target_logit = jnp.take_along_axis(logits_BxTxV, safe_targets[..., None], axis=-1)[..., 0]
    nll_BxT = (log_norm - target_logit) * mask_BxT
    # The target is the model's top guess when its logit is the maximum (ties count as right).
    # Cheaper than argmax, which XLA:CPU does not vectorise (~2% of a small model's step).
    correct_BxT = (target_logit >= logits_BxTxV.max(axis=-1)) & mask_BxT
    return {
        "loss_sum": nll_BxT.sum(),
        "correct": correct_BxT.sum().astype(jnp.float32),
        "tokens": mask_BxT.sum().astype(jnp.float32),
    }


# Vocabularies from this size on get the chunked loss: float32 logits of a whole batch would
# dominate memory (vocab 49152, batch 8 x 512: 805 MB, and as much again for their gradient).
CHUNKED_LOSS_MIN_VOCAB = 32768
# Target float32 logits per chunk (elements): 2**24 = 64 MiB.
CHUNK_LOGITS = 2**24


def chunked_causal_lm_sums(
    hidden: jax.Array,
    project: Callable[[jax.Array], jax.Array],
    labels: jax.Array,
    *,
    chunk_tokens: int,
) -> dict[str, jax.Array]:
    """``causal_lm_sums`` from hidden states [B, T, D], ``chunk_tokens`` positions at a time.

    ``project`` maps hidden states to logits (the model's output head). Each chunk's logits
    live only inside one scan step, so no [B, T, V] array ever exists. Under differentiation
    the same step also forms the loss's gradient for the chunk's hidden states and for the
    head's weights (Liger's fused linear cross-entropy does the same): the backward pass only
    scales them, where recomputing every chunk's logits there made the step of a 2-layer
    model with a 49k vocabulary 1.29x slower than whole-batch logits (bench/RESULTS.md).
    """
    d = hidden.shape[-1]
    h = hidden[:, :-1].reshape(-1, d)
    targets = labels[:, 1:].reshape(-1)
    n = targets.shape[0]
    chunk_tokens = min(chunk_tokens, n)
    chunks = -(-n // chunk_tokens)
    pad = chunks * chunk_tokens - n
    h = jnp.pad(h, ((0, pad), (0, 0))).reshape(chunks, chunk_tokens, d)
    targets = jnp.pad(targets, (0, pad), constant_values=IGNORE_INDEX)
    targets = targets.reshape(chunks, chunk_tokens)
    # The head's weights become explicit arguments, so the gradient can be formed for them.
    head, weights = jax.closure_convert(project, h[0])
    return _fused_chunk_sums(head, h, targets, *weights)


def _chunk_sums(head: Callable, h_c, t_c, weights) -> tuple[dict[str, jax.Array], Callable]:
    """One chunk's sums and the vjp of those sums in (h_c, *weights), through the logits."""

    def sums_of(h_c, *weights):
        logits = head(h_c, *weights).astype(jnp.float32)
        return causal_lm_sums(logits[:, None], t_c[:, None], shifted=True)

    return jax.vjp(sums_of, h_c, *weights)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused_chunk_sums(head: Callable, h, targets, *weights) -> dict[str, jax.Array]:
    def body(carry, xs):
        sums, _ = _chunk_sums(head, *xs, weights)
        return jax.tree.map(jnp.add, carry, sums), None

    sums, _ = jax.lax.scan(body, _zero_sums(), (h, targets))
    return sums


def _fused_chunk_sums_fwd(head: Callable, h, targets, *weights):
    # With symbolic zeros each argument says whether it is differentiated: a frozen head
    # (LoRA's base, a teacher) gets no gradient, so none is formed or accumulated for it.
    trained = [w.perturbed for w in weights]
    h, targets, weights = h.value, targets.value, [w.value for w in weights]

    def body(carry, xs):
        sums_acc, grads_acc = carry
        sums, vjp = _chunk_sums(head, *xs, weights)
        # d loss_sum only: tokens and correct are counts, not differentiable.
        d_h, *d_weights = vjp({"loss_sum": 1.0, "correct": 0.0, "tokens": 0.0})
        d_weights = [g for g, t in zip(d_weights, trained) if t]
        grads_acc = [a + g.astype(jnp.float32) for a, g in zip(grads_acc, d_weights)]
        return (jax.tree.map(jnp.add, sums_acc, sums), grads_acc), d_h

    zero_grads = [jnp.zeros_like(w, jnp.float32) for w, t in zip(weights, trained) if t]
    (sums, d_weights), d_h = jax.lax.scan(body, (_zero_sums(), zero_grads), (h, targets))
    grads = iter(d_weights)
    d_weights = [next(grads).astype(w.dtype) if t else None for w, t in zip(weights, trained)]
    return sums, (d_h, d_weights)


def _fused_chunk_sums_bwd(head: Callable, residuals, cotangent):
    d_h, d_weights = residuals
    scale = cotangent["loss_sum"]  # the sums are linear in it; counts carry no gradient
    if isinstance(scale, SymbolicZero):
        return (None, None, *(None for _ in d_weights))
    return (
        d_h * scale.astype(d_h.dtype),
        None,
        *(None if g is None else g * scale.astype(g.dtype) for g in d_weights),
    )


_fused_chunk_sums.defvjp(_fused_chunk_sums_fwd, _fused_chunk_sums_bwd, symbolic_zeros=True)


def _zero_sums() -> dict[str, jax.Array]:
    zero = jnp.zeros((), jnp.float32)
    return {"loss_sum": zero, "correct": zero, "tokens": zero}


def causal_lm_loss_sums(model: nnx.Module, batch: dict[str, jax.Array], rng: jax.Array):
    """Default loss of the Trainer: a causal LM called as model(input_ids, ...) -> logits.

    Models with ``hidden_states`` and ``output_projection`` (the Llama family) and a
    vocabulary of at least CHUNKED_LOSS_MIN_VOCAB get the chunked loss (same sums).
    Models with ``returns_aux_losses`` (mixture-of-experts) also return their auxiliary
    losses; see ``add_aux_losses``.
    """
    del rng  # the Llama family has no dropout; custom losses may use it
    kwargs: dict[str, Any] = dict(
        positions=batch.get("positions"), segment_ids=batch.get("segment_ids")
    )
    with_aux = bool(getattr(model, "returns_aux_losses", False))
    if with_aux:
        kwargs["return_aux"] = True
    vocab = getattr(getattr(model, "config", None), "vocab_size", 0)
    if vocab >= CHUNKED_LOSS_MIN_VOCAB and hasattr(model, "output_projection"):
        out = model.hidden_states(batch["input_ids"], **kwargs)
        hidden, aux = out if with_aux else (out, None)
        chunk = max(64, CHUNK_LOGITS // vocab // 64 * 64)
        sums = chunked_causal_lm_sums(
            hidden, model.output_projection(), batch["labels"], chunk_tokens=chunk
        )
    else:
        out = model(batch["input_ids"], **kwargs)
        logits, aux = out if with_aux else (out, None)
        sums = causal_lm_sums(logits, batch["labels"])
    return sums if aux is None else add_aux_losses(sums, aux)


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
    optimizer: optax.GradientTransformation,
    schedule: optax.Schedule,
    seed: int,
    loss_sums_fn: LossSumsFn = causal_lm_loss_sums,
    normalizer_fn: Callable[[dict[str, jax.Array]], jax.Array] = count_target_tokens,
) -> Callable[[TrainState, dict[str, jax.Array]], tuple[TrainState, dict[str, jax.Array]]]:
    """Build `train_step(state, batch, frozen=None)`; batch leaves are [A, ...] (micro-batches).

    `frozen` is the model's non-Param state (frozen weights such as a DPO reference, a teacher
    or LoRA's base kernels): an argument, so that it is placed on the mesh like any input and
    not baked into the compiled program as a constant. Without it, `rest` is used.
    """

    def micro_loss(params, frozen, micro_batch, rng, normalizer):
        model = nnx.merge(graphdef, params, frozen)
        sums = check_loss_sums(loss_sums_fn(model, micro_batch, rng))  # at trace time
        return sums["loss_sum"] / normalizer, sums

    grad_fn = jax.grad(micro_loss, has_aux=True)

    def train_step(state: TrainState, batch: dict[str, jax.Array], frozen: Any = None):
        frozen = rest if frozen is None else frozen
        normalizer = jnp.maximum(normalizer_fn(batch), 1.0)
        step_key = jax.random.fold_in(jax.random.key(seed), state.step)
        num_micro = jax.tree.leaves(batch)[0].shape[0]

        if num_micro == 1:
            micro = jax.tree.map(lambda x: x[0], batch)
            grads, sums = grad_fn(state.params, frozen, micro, step_key, normalizer)
        else:

            def accumulate(carry, inputs):
                grads_acc, sums_acc = carry
                index, micro = inputs
                micro_key = jax.random.fold_in(step_key, index)
                grads, sums = grad_fn(state.params, frozen, micro, micro_key, normalizer)
                grads_acc = jax.tree.map(lambda a, g: a + g.astype(a.dtype), grads_acc, grads)
                sums_acc = jax.tree.map(jnp.add, sums_acc, sums)
                return (grads_acc, sums_acc), None

            first = jax.tree.map(lambda x: x[0], batch)
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
        return new_state, metrics

    return train_step


def make_eval_step(
    *,
    graphdef: nnx.GraphDef,
    rest: nnx.State | None = None,
    loss_sums_fn: LossSumsFn = causal_lm_loss_sums,
) -> Callable[..., dict[str, jax.Array]]:
    """Build `eval_step(params, batch, frozen=None) -> sums`, the same reduction as training."""

    def eval_step(params, batch, frozen=None):
        frozen = rest if frozen is None else frozen
        model = nnx.merge(graphdef, params, frozen)
        return check_loss_sums(loss_sums_fn(model, batch, jax.random.key(0)))

    return eval_step
