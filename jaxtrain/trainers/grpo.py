"""GRPO (Shao et al. 2024, DeepSeekMath) and its variants Dr. GRPO and DAPO on the Trainer.

Each update: take total_batch_size / num_generations prompts, sample num_generations
completions of each from the live policy (the compiled KV-cache sampler, on the run's mesh),
score them with Python reward functions on the host, turn the rewards into advantages per
group, and step on the clipped surrogate (grpo_loss.py). A generated batch serves
num_iterations updates (the later ones with the log-probs of the policy that sampled it).

Why generation runs in the Trainer's own hooks (`on_step_start` keeps the live state,
`on_batch` swaps the prompt batch for the scored completions) rather than in a data
collator: sampling needs the newest parameters, which only the loop holds, while the loop,
the compiled step, checkpoints and logging stay the base Trainer's, unchanged. The train
loader yields prompt rows only (PromptLoader: a pure function of seed and step), so a
resumed run regenerates with the same prompts and the same sampling key; a checkpoint inside
a round keeps the round's batch (grpo_round.py), so the resumed updates reuse it. Every shape
is fixed (prompts left-padded to max_prompt_length, completions max_completion_length), so
the sampler and the train step compile once.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtrain.arguments import ArgumentError
from jaxtrain.config.sections import DataSettings
from jaxtrain.data import DataMeter
from jaxtrain.data.collate import IGNORE_INDEX
from jaxtrain.data.errors import DatasetError
from jaxtrain.models.generation import sample_left_padded
from jaxtrain.models.kv_cache import supports_kv_cache
from jaxtrain.task_arguments import GRPOArguments
from jaxtrain.trainers.base import TaskTrainer, concrete_model, task_runtime
from jaxtrain.trainers.frozen import TaskModel
from jaxtrain.trainers.grpo_loss import group_advantages, grpo_loss_sums, grpo_normalizer
from jaxtrain.trainers.grpo_prompts import PromptLoader
from jaxtrain.trainers.grpo_round import GeneratedRound
from jaxtrain.trainers.rewards import load_reward, reward_name, score_completions
from jaxtrain.training.logps import model_token_logps

__all__ = ["GRPOArguments", "GRPOTrainer", "PromptLoader"]

logger = logging.getLogger(__name__)

PROMPT_ID_COLUMNS = ("prompt_ids", "input_ids")


@contextlib.contextmanager
def adapters_off(model: nnx.Module):
    """`model` without its LoRA adapters while inside (traced: the base weights alone)."""
    from jaxtrain.models.lora import lora_projections

    saved = [(m, m.lora) for _, m in lora_projections(model)]
    for m, _ in saved:
        m.lora = None
    try:
        yield model
    finally:
        for m, lora in saved:
            m.lora = lora


class GRPOTrainer(TaskTrainer):
    """Online RL from reward functions: see the module docstring and docs/tasks.md "GRPO".

    `reward_funcs`: callables `fn(prompts, completions, **columns) -> list[float | None]`
    (default: `arguments.reward`, paths or built-ins). `reference_model`: the KL reference
    when beta > 0 (default: a frozen copy of `model` now; with LoRA the base without the
    adapters, no copy).
    """

    loss_is_token_nll = False

    def __init__(
        self,
        arguments: GRPOArguments | None = None,
        model: Any = None,
        reward_funcs: Callable | Sequence[Callable] | None = None,
        dataset_train: Any = None,
        processing_class: Any = None,
        reference_model: Any = None,
        **kwargs: Any,
    ):
        args = arguments if arguments is not None else GRPOArguments()
        if not isinstance(args, GRPOArguments):
            raise ArgumentError("GRPOTrainer needs GRPOArguments (num_generations, beta, ...).")
        if kwargs.get("dataset_eval") is not None:
            raise ArgumentError("GRPOTrainer has no evaluation yet: pass dataset_eval=None.")
        if processing_class is None:
            raise ArgumentError(
                "GRPOTrainer needs processing_class=tokenizer (prompts are tokenized and "
                "completions decoded for the reward functions)."
            )
        self.grpo_args, self.processing_class = args, processing_class
        self.reward_funcs = self._reward_funcs(reward_funcs, args)
        weights = args.reward_weights or [1.0] * len(self.reward_funcs)
        if len(weights) != len(self.reward_funcs):
            raise ArgumentError(
                f"GRPOArguments.reward_weights has {len(weights)} weights for "
                f"{len(self.reward_funcs)} reward functions; give one per function."
            )
        self.reward_weights = np.asarray(weights, np.float64)
        if dataset_train is None:
            raise ArgumentError("GRPOTrainer needs dataset_train (the prompts).")
        self._read_prompts(dataset_train)  # checked before anything compiles
        model = concrete_model(model, args, task_runtime(args, kwargs))
        if not supports_kv_cache(model):
            raise ArgumentError(
                f"GRPO samples with the KV-cache generator; {type(model).__name__} has no KV "
                "cache (the Llama family and its MoE, Gemma 2/3 and GPT-2 have)."
            )
        reference = None
        if args.beta > 0 and (reference_model is not None or not args.lora_rank):
            reference = (
                concrete_model(reference_model, args, kwargs["runtime"])
                if reference_model is not None
                else nnx.clone(model)
            )
        self._round: GeneratedRound | None = None  # the batch the current round's steps reuse
        self._live_state = None
        self._last_batch_time: float | None = None
        self._last_generation_s = 0.0
        self._old_logps_fn = None
        super().__init__(
            arguments=args,
            model=TaskModel(model, reference=reference),
            dataset_train=dataset_train,
            processing_class=processing_class,
            **kwargs,
        )
        eos = getattr(processing_class, "eos_token_id", None)
        if eos is None:
            eos = getattr(self.model_config, "eos_token_id", None)
        self.eos_token_ids = [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])
                              if e is not None]  # fmt: skip

    @staticmethod
    def _reward_funcs(funcs: Any, args: GRPOArguments) -> list[Callable]:
        if funcs is None:
            funcs = [load_reward(s, format_pattern=args.format_pattern) for s in args.reward or []]
        funcs = list(funcs) if isinstance(funcs, (list, tuple)) else [funcs]
        if not funcs:
            raise ArgumentError(
                "GRPOTrainer needs reward functions: reward_funcs=[fn, ...] or "
                "GRPOArguments.reward (e.g. ['last_number_matches'] or ['my_module:fn'])."
            )
        for fn in funcs:
            if not callable(fn):
                raise ArgumentError(f"reward function {fn!r} is not callable.")
        return funcs

    # ------------------------------------------------------------------ prompts
    def _read_prompts(self, dataset: Any) -> None:
        """Every prompt tokenized (left-truncated to max_prompt_length, with a warning giving
        the share), what reward functions receive as `prompts`, and the other columns."""
        rows = _rows(dataset)
        if not rows:
            raise DatasetError("dataset_train is empty; pass at least one prompt row")
        names = list(rows[0])
        tok, limit = self.processing_class, self.grpo_args.max_prompt_length
        if "prompt" in names and not isinstance(rows[0]["prompt"], (list, tuple)):
            kind, used = "text", ["prompt"]
        elif "prompt" in names or "messages" in names:
            kind, used = "chat", ["prompt" if "prompt" in names else "messages"]
        elif any(c in names for c in PROMPT_ID_COLUMNS):
            kind, used = "ids", [next(c for c in PROMPT_ID_COLUMNS if c in names)]
        else:
            raise DatasetError(
                f"dataset_train has columns {names}; GRPO prompts are a `prompt` text column, "
                "chat `messages` (or a `prompt` list of messages), or token ids (`prompt_ids`)"
            )
        ids, shown, cut = [], [], 0
        for i, row in enumerate(rows):
            value = row[used[0]]
            if kind == "text":
                tokens, text = tok(value, add_special_tokens=True)["input_ids"], value
            elif kind == "chat":
                text = tok.apply_chat_template(value, add_generation_prompt=True, tokenize=False)
                tokens = tok(text, add_special_tokens=False)["input_ids"]
                text = value  # reward functions get the messages, as TRL passes them
            else:
                tokens, text = list(value), tok.decode(list(value))
            if not len(tokens):
                raise DatasetError(f"dataset_train row {i}: the prompt is empty")
            cut += len(tokens) > limit
            ids.append(np.asarray(tokens[-limit:], np.int32))  # the end is what is answered
            shown.append(text)
        if cut:
            logger.warning(
                "GRPO: %d of %d prompts (%.1f%%) are longer than max_prompt_length=%d; their "
                "start is cut. Raise max_prompt_length to keep them whole.",
                cut, len(rows), 100 * cut / len(rows), limit,
            )  # fmt: skip
        self.prompt_truncated_share = cut / len(rows)
        self._prompt_ids, self._prompt_values = ids, shown
        self._columns = {c: [r[c] for r in rows] for c in names if c not in used}

    def _build_loaders(self, dataset_train: Any, dataset_eval: Any) -> None:
        args = self.grpo_args
        self.dataset_train, self.dataset_eval = dataset_train, None
        self.data_settings = DataSettings.from_arguments(args)
        if self.runtime.process_count > 1:
            raise ArgumentError("GRPOTrainer runs on one process (one host) for now.")
        self.train_loader = PromptLoader(
            len(self._prompt_ids),
            args.total_batch_size // args.num_generations,
            args.num_iterations,
            args.seed,
            args.shuffle_train,
            group=args.num_generations,
            accumulation=args.gradient_accumulation_steps,
        )
        self.eval_loader = None
        self.sharding_plan.batch.check(args.micro_batch_size, self.sequence_length, "micro-batch")
        self.data_meter = DataMeter()

    @property
    def sequence_length(self) -> int:
        return self.grpo_args.max_prompt_length + self.grpo_args.max_completion_length

    # ------------------------------------------------------------------ objective
    def compute_loss_sums(self, model: TaskModel, batch: dict[str, jax.Array], rng: jax.Array):
        del rng
        args = self.grpo_args
        ids, labels = batch["input_ids"], batch["labels"]
        # The entropy comes out of the same (chunked) logits as the log-probs.
        logps, mask, entropy = model_token_logps(model.model, ids, labels, entropy=True)
        ref = None
        if args.beta > 0:
            if model.reference is not None:
                ref, _ = model_token_logps(model.reference, ids, labels)
            else:  # LoRA: the base model is the policy without its adapters
                with adapters_off(model.model) as base:
                    ref, _ = model_token_logps(base, ids, labels)
            ref = jax.lax.stop_gradient(ref)
        sums = grpo_loss_sums(
            logps, batch.get("old_logps"), ref, batch["advantages"], mask,
            loss_type=args.loss_type, beta=args.beta, epsilon=args.epsilon,
            epsilon_high=args.epsilon_high, max_completion_length=args.max_completion_length,
            kl_ratio_weight=args.kl_ratio_weight,
        )  # fmt: skip
        mask = mask.astype(jnp.float32)
        units = self._units(mask)
        row_entropy = entropy.sum(-1) / jnp.maximum(mask.sum(-1), 1.0)
        return {
            "loss_sum": sums["loss_sum"],
            "tokens": units.sum(),
            # KL, clip ratio and entropy: token means, weighted per unit like the loss (per
            # completion for grpo/dr_grpo, per micro-batch for bnpo, per token for dapo).
            "kl_sum": (units * sums["row_kl"]).sum(),
            "clip_ratio_sum": (units * sums["row_clipped"]).sum(),
            "entropy_sum": (units * row_entropy).sum(),
        }

    def _units(self, mask: jax.Array) -> jax.Array:
        """Each row's weight in the unit the loss is averaged over ([B])."""
        loss_type = self.grpo_args.loss_type
        if loss_type == "dapo":
            return mask.sum(-1)
        if loss_type == "bnpo":
            return mask.sum(-1) / jnp.maximum(mask.sum(), 1.0)
        return jnp.ones(mask.shape[0], jnp.float32)

    def loss_normalizer(self, batch: dict[str, jax.Array]) -> jax.Array:
        return grpo_normalizer(self.grpo_args.loss_type, batch["labels"][..., 1:] != IGNORE_INDEX)

    # ---------------------------------------------------------- generated batches
    def on_step_start(self, trainer: Any, state: Any, step: int) -> None:
        self._live_state = state  # the parameters this step's completions are sampled from

    def on_batch(self, trainer: Any, batch: dict[str, Any], step: int):
        # The previous update may still run (async dispatch): wait for it, so its time counts
        # as training, not as this step's generation (which needs its parameters anyway).
        jax.block_until_ready(self._live_state.params)
        now = time.perf_counter()
        logs: dict[str, float] = {}
        if self._last_batch_time is not None:  # the previous step's rest: its update
            logs["time/training_s"] = now - self._last_batch_time
        generation = step // self.grpo_args.num_iterations
        if self._round is None and step % self.grpo_args.num_iterations:
            # Resumed inside a round from a checkpoint that does not keep its batch (see
            # resume_extra): said, not hidden.
            logger.warning(
                "GRPO resumed at step %d, inside a round of num_iterations=%d updates, from a "
                "checkpoint that does not hold the round's generated batch (written by an "
                "older jaxtrain, or with another num_iterations): its completions are sampled "
                "again (same key) from the resumed parameters, and the rest of this round "
                "differs from an uninterrupted run.",
                step,
                self.grpo_args.num_iterations,
            )
        if self._round is None or self._round.generation != generation:
            placed, round_logs, host = self.generate_batch(self._live_state, step)
            self._round = GeneratedRound(
                generation, placed, round_logs, self.last_completions, host
            )
            self._last_generation_s = round_logs["time/generation_s"]
        else:
            self._last_generation_s = 0.0
        self._last_batch_time = time.perf_counter()
        host = self.train_loader.handed_out.pop(step, None)
        if host is not None:  # counted by the loop after this hook: tokens/s of completions
            host.update(self._round.host)
        return self._round.batch, {**self._round.logs, **logs,
                                   "time/generation_s": self._last_generation_s}  # fmt: skip

    def checkpoint_extra(self, step: int) -> tuple[dict[str, Any], Any] | None:
        """Inside a round (step `step` reuses the batch of the steps before it): the round's
        batch and logs, so a resume finishes the round exactly. At a boundary: nothing."""
        n, current = self.grpo_args.num_iterations, self._round
        if current is None or step % n == 0 or current.generation != step // n:
            return None
        return current.checkpoint(n)

    def resume_extra(
        self, details: dict[str, Any], restore: Callable[[Any], Any], step: int
    ) -> None:
        """The round a checkpoint kept becomes the current one (the next steps reuse it);
        one that does not continue at `step` (num_iterations changed) is left unread."""
        if GeneratedRound.fits(details, step, self.grpo_args.num_iterations):
            self._round = GeneratedRound.restored(details, restore, self._abstract_batch())
            self.last_completions = self._round.completions

    def sampling_key(self, step: int) -> jax.Array:
        """The key of the completions of `step`'s round: a function of the seed and the
        round only, so a resumed run samples what the uninterrupted one did."""
        return jax.random.fold_in(
            jax.random.key(self.grpo_args.seed), step // self.grpo_args.num_iterations
        )

    def generate_batch(
        self, state: Any, step: int
    ) -> tuple[dict[str, jax.Array], dict[str, float], dict[str, np.ndarray]]:
        """The scored completions of `step`'s prompts as a global train batch, its logs, and
        its input_ids and labels on the host."""
        args, g = self.grpo_args, self.grpo_args.num_generations
        start = time.perf_counter()
        rows = np.repeat(self.train_loader.rows_at(step), g)  # each prompt's group, together
        n, plen, clen = len(rows), args.max_prompt_length, args.max_completion_length
        prompt = np.full((n, plen), self.pad_token_id, np.int32)
        pad = np.zeros(n, np.int32)
        for i, r in enumerate(rows):
            p = self._prompt_ids[r]
            prompt[i, plen - len(p) :], pad[i] = p, plen - len(p)
        tokens = self.sample(state, prompt, pad, step)
        generation_s = time.perf_counter() - start
        is_eos = np.isin(tokens, self.eos_token_ids)
        ended = is_eos.any(1)
        length = np.where(ended, is_eos.argmax(1) + 1, clen)
        scored = ~(~ended & args.mask_truncated_completions)
        texts = self.processing_class.batch_decode(
            [tokens[i, : length[i]].tolist() for i in range(n)], skip_special_tokens=True
        )
        per_func = score_completions(
            self.reward_funcs,
            [self._prompt_values[r] for r in rows],
            texts,
            {k: [v[r] for r in rows] for k, v in self._columns.items()},
        )
        unscored = np.isnan(per_func).all(1)
        rewards = np.nansum(per_func * self.reward_weights, axis=1)
        rewards[unscored] = np.nan
        advantages, equal = group_advantages(rewards, g, args.scale_rewards)
        host = self._train_rows(rows, tokens, length, scored, advantages)
        placed = self.sharding_plan.batch.to_global(host, micro_axis=True)
        if args.num_iterations > 1:  # later updates compare with the sampling policy
            placed["old_logps"] = self._old_logps(state, placed)
        logs = {
            "reward": float(np.nanmean(rewards)),
            "reward_std": float(np.nanstd(rewards, ddof=1)) if n > 1 else 0.0,
            "frac_reward_zero_std": float(equal.reshape(-1, g)[:, 0].mean()),
            "completions/mean_length": float(length.mean()),
            "completions/min_length": float(length.min()),
            "completions/max_length": float(length.max()),
            "completions/clipped_ratio": float((~ended).mean()),
            "time/generation_s": generation_s,
        }
        for j, fn in enumerate(self.reward_funcs):
            column = per_func[:, j]
            if not np.isnan(column).all():
                logs[f"rewards/{reward_name(fn)}"] = float(np.nanmean(column))
        self.last_completions = texts  # for inspection (tests, callbacks)
        return placed, logs, {k: host[k] for k in ("input_ids", "labels")}

    def sample(self, state: Any, prompt: np.ndarray, pad: np.ndarray, step: int) -> np.ndarray:
        """Completions [N, max_completion_length] of left-padded prompts [N, P] (`pad`: each
        row's padding) from the live parameters, on the run's mesh."""
        args = self.grpo_args
        graphdef, params = nnx.split(self.model_from_state(state))
        tokens, _ = sample_left_padded(
            graphdef, params, jnp.asarray(prompt), jnp.asarray(pad), self.sampling_key(step),
            max_new_tokens=args.max_completion_length, temperature=args.temperature,
            top_p=args.top_p, top_k=args.top_k, eos_token_ids=self.eos_token_ids,
        )  # fmt: skip
        return np.asarray(tokens)  # only completions cross to the host

    def _train_rows(self, rows, tokens, length, scored, advantages) -> dict[str, np.ndarray]:
        """[A, M, T] rows: prompt then completion, right-padded (causal attention never
        lets a real token see the padding); labels are the scored completion tokens."""
        args, n = self.grpo_args, len(rows)
        ids = np.full((n, self.sequence_length), self.pad_token_id, np.int32)
        labels = np.full((n, self.sequence_length), IGNORE_INDEX, np.int32)
        for i, r in enumerate(rows):
            p, c = self._prompt_ids[r], tokens[i, : length[i]]
            ids[i, : len(p)], ids[i, len(p) : len(p) + len(c)] = p, c
            if scored[i]:
                labels[i, len(p) : len(p) + len(c)] = c
        a = args.gradient_accumulation_steps
        host = {"input_ids": ids, "labels": labels, "advantages": advantages}
        return {k: v.reshape(a, n // a, *v.shape[1:]) for k, v in host.items()}

    def _old_logps(self, state: Any, batch: dict[str, jax.Array]) -> jax.Array:
        if self._old_logps_fn is None:
            graphdef = self.graphdef

            @jax.jit
            def old_logps(params, rest, ids, labels):
                model = nnx.merge(graphdef, params, rest).model
                flat = lambda x: x.reshape(-1, x.shape[-1])  # noqa: E731
                logps, _ = model_token_logps(model, flat(ids), flat(labels))
                return logps.reshape(*ids.shape[:2], -1)

            self._old_logps_fn = old_logps
        out = self._old_logps_fn(
            state.params, self.frozen_state(), batch["input_ids"], batch["labels"]
        )
        return jax.device_put(out, self.sharding_plan.batch.sharding(3, micro_axis=True))

    def _abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        """The generated train batch's shapes, dtypes and shardings ([A, M, ...] global)."""
        args, a = self.grpo_args, self.grpo_args.gradient_accumulation_steps
        m, t = args.total_batch_size // a, self.sequence_length
        shapes = {
            "input_ids": ((a, m, t), jnp.int32),
            "labels": ((a, m, t), jnp.int32),
            "advantages": ((a, m), jnp.float32),
        }
        if args.num_iterations > 1:
            shapes["old_logps"] = ((a, m, t - 1), jnp.float32)
        layout = self.sharding_plan.batch
        return {
            k: jax.ShapeDtypeStruct(
                shape, dtype, sharding=layout.sharding(len(shape), micro_axis=True)
            )
            for k, (shape, dtype) in shapes.items()
        }

    def lower_train_step(self, state: Any, batch: dict[str, Any], progress: Any = None):
        """The step is compiled for the generated batches, not the loader's prompt rows."""
        return super().lower_train_step(state, self._abstract_batch(), progress)


def _rows(dataset: Any) -> list[dict[str, Any]]:
    """Row dicts of a datasets.Dataset, a dict of columns or a list of rows."""
    if isinstance(dataset, dict):
        names = list(dataset)
        return [dict(zip(names, values)) for values in zip(*dataset.values())]
    if hasattr(dataset, "column_names") and isinstance(dataset.column_names, dict):
        raise ArgumentError("pass one split (dataset['train']), not a DatasetDict")
    return [dict(r) for r in dataset]
