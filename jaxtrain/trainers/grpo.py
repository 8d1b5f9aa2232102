"""GRPO (Shao et al. 2024, DeepSeekMath) and its variants Dr. GRPO and DAPO on the Trainer.

GRPOTrainer is a configuration of the Trainer's parts, given in one pass: the policy (and a
frozen reference when beta > 0) as one TaskModel, the clipped surrogate objective
(grpo_loss.py) and an on-policy batch source of scored rollouts (grpo_source.py), which the
loop hands the live parameters at every step. The loop, the compiled step, checkpoints and
logging are the base Trainer's, unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxtrain.arguments import ArgumentError
from jaxtrain.config.parallel_checks import rollout_split
from jaxtrain.config.sections import RunSettings
from jaxtrain.data.chat import with_chat_template
from jaxtrain.data.collate import IGNORE_INDEX
from jaxtrain.data.vision import text_tokenizer
from jaxtrain.models.kv_cache import supports_kv_cache
from jaxtrain.models.lora import adapters_off
from jaxtrain.parallel.process_local import gather_shares
from jaxtrain.rollout_arguments import GRPOArguments, RolloutArguments
from jaxtrain.serving.tool_chat import check_tool_template
from jaxtrain.trainers.base import (
    TaskStart,
    concrete_model,
    task_arguments,
    task_pad_token_id,
    task_settings,
)
from jaxtrain.trainers.frozen import TaskModel
from jaxtrain.trainers.grpo_loss import clip_metric_name, grpo_loss_sums, grpo_normalizer
from jaxtrain.trainers.grpo_prompts import PromptLoader, read_prompts
from jaxtrain.trainers.grpo_source import RolloutSource
from jaxtrain.trainers.rewards import load_reward, reward_name
from jaxtrain.trainers.tools import ToolCalls, load_tools
from jaxtrain.training.logps import model_token_logps
from jaxtrain.training.program import Objective
from jaxtrain.training.trainer import Trainer

__all__ = ["GRPOArguments", "GRPOTrainer", "PromptLoader", "grpo_objective"]


class GRPOTrainer(Trainer):
    """Online RL from reward functions: see the module docstring and docs/tasks.md "GRPO".

    `reward_funcs`: callables `fn(prompts, completions, **columns) -> list[float | None]`
    (default: `arguments.reward`, paths or built-ins). `reference_model`: the KL reference
    when beta > 0 (default: a frozen copy of `model` now; with LoRA the base without the
    adapters, no copy). `tools` (functions) and `environment_factory` (a class with
    `reset(**row)`, whose public methods are tools): the model may call them, over several
    turns (tools.py, tool_rollouts.py; default `arguments.tools` / `arguments.environment`).
    """

    # What a task on GRPO's rollouts changes (RLOOTrainer): its arguments, the source that
    # samples and scores, its objective.
    arguments_class: type[RolloutArguments] = GRPOArguments
    source_class: type[RolloutSource] = RolloutSource

    @staticmethod
    def task_objective(settings: RunSettings) -> Objective:
        return grpo_objective(settings)

    def __init__(
        self,
        arguments: RolloutArguments | None = None,
        model: Any = None,
        reward_funcs: Callable | Sequence[Callable] | None = None,
        dataset_train: Any = None,
        processing_class: Any = None,
        reference_model: Any = None,
        tools: Sequence[Callable] | None = None,
        environment_factory: Callable | None = None,
        dataset_eval: Any = None,
        **kwargs: Any,
    ):
        name = type(self).__name__
        args = task_arguments(arguments, self.arguments_class, name)
        if processing_class is None:
            raise ArgumentError(
                f"{name} needs processing_class=tokenizer (prompts are tokenized and "
                "completions decoded for the reward functions)."
            )
        settings = task_settings(args, kwargs)
        # The run's chat template renders its prompts, tool calls and turns, and is saved with
        # the run's tokenizer.
        processing_class = with_chat_template(processing_class, settings.data.chat_template)
        tool_calls = self._tool_calls(tools, environment_factory, settings, processing_class)
        extra = tool_calls.rewards if tool_calls is not None else []  # environments' get_reward
        reward_funcs = self._reward_funcs(reward_funcs, settings, extra)
        weights = settings.task.reward_weights or [1.0] * len(reward_funcs)
        if len(weights) != len(reward_funcs):
            raise ArgumentError(
                f"{type(args).__name__}.reward_weights has {len(weights)} weights for "
                f"{len(reward_funcs)} reward functions; give one per function."
            )
        if dataset_train is None:
            raise ArgumentError(f"{name} needs dataset_train (the prompts).")
        shown = tool_calls.shown if tool_calls is not None else None  # each row's tools
        prompts = read_prompts(
            dataset_train, processing_class, settings.task.max_prompt_length, shown
        )
        eval_prompts = None
        if dataset_eval is not None:  # prompts whose completions are scored, not trained on
            eval_prompts = read_prompts(
                dataset_eval, processing_class, settings.task.max_prompt_length, shown
            )
        rollout_mesh, devices = split_rollout_devices(settings, kwargs)
        start = TaskStart.resolve(args, kwargs, settings=settings, devices=devices)
        runtime = start.runtime
        check_process_groups(settings, runtime.process_count)
        sequence_length = settings.task.max_prompt_length + settings.task.max_completion_length
        runtime.plan.batch.check(settings.data.micro_batch_size, sequence_length, "micro-batch")
        model = concrete_model(model, settings.model, runtime)
        if not supports_kv_cache(model):
            raise ArgumentError(
                f"GRPO samples on the serving engine's KV cache; {type(model).__name__} has no KV "
                "cache (the Llama family and its MoE, Gemma 2/3 and GPT-2 have)."
            )
        routing = getattr(model.config, "routing_shape", None)  # a MoE policy's
        check_routing_replay(settings, routing, tool_calls)
        check_rollout_processes(settings, runtime.process_count, tool_calls)
        if tool_calls is not None:  # a multi-turn rollout's turns record no routing (yet)
            routing = None
        reference = None
        if settings.task.beta > 0 and (reference_model is not None or not settings.model.lora_rank):
            reference = (
                concrete_model(reference_model, settings.model, runtime)
                if reference_model is not None
                else nnx.clone(model)
            )
        text = text_tokenizer(processing_class)  # a vision-language model's processor's
        eos = getattr(text, "eos_token_id", None)
        if eos is None:
            eos = getattr(getattr(model, "config", None), "eos_token_id", None)
        eos_ids = [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])
                   if e is not None]  # fmt: skip
        source = self.source_class(
            settings,
            prompts,
            tokenizer=text,
            reward_funcs=reward_funcs,
            reward_weights=np.asarray(weights, np.float64),
            layout=runtime.plan.batch,
            pad_token_id=task_pad_token_id(processing_class, model),
            eos_token_ids=eos_ids,
            eval_prompts=eval_prompts,
            tool_calls=tool_calls,
            rollout_mesh=rollout_mesh,
            routing=routing,
        )
        super().__init__(
            **start.trainer_kwargs(
                arguments=args,
                model=TaskModel(model, reference=reference),
                dataset_train=dataset_train,
                processing_class=processing_class,
                train_source=source,
                objective=self.task_objective(settings),
            )
        )

    @property
    def reward_funcs(self) -> list[Callable]:
        """The run's reward functions (given, loaded from `reward`, and an environment's)."""
        return self.train_source.reward_funcs

    @property
    def last_completions(self) -> list[str]:
        """The decoded completions of the newest round."""
        return self.train_source.last_completions

    @property
    def evaluates(self) -> bool:
        """Whether there are eval prompts (dataset_eval) to sample and score."""
        return self.train_source.eval_prompts is not None

    def eval(self, state: Any, max_batches: int | None = None):
        """Yields `evaluate(state)`: GRPO's evaluation is one pass over the eval prompts."""
        yield self.evaluate(state, max_batches)

    def evaluate(self, state: Any, max_batches: int | None = None) -> dict[str, float]:
        """eval_num_generations completions of every eval prompt, sampled like the rollouts
        (a seed of their own, the same at every evaluation), scored by the reward functions:
        the mean weighted reward, each function's mean, the mean completion length, and
        pass@k (the share of prompts with a completion reaching eval_pass_threshold).
        `max_batches` is the batches of an eval set: the prompts are all sampled."""
        del max_batches
        settings, source = self.settings, self.train_source
        prompts = source.eval_prompts
        source.settle()  # the engine finishes the rounds sampled ahead first
        if prompts is None:
            raise ArgumentError(f"{type(self).__name__}.evaluate needs dataset_eval (prompts).")
        k, seed = settings.task.eval_num_generations, settings.data.seed + 0x5EED
        # Each process completes and scores its contiguous share of the prompts.
        shares = np.array_split(np.arange(len(prompts)), source.process_count)
        mine = shares[source.process_index]
        index = np.repeat(mine, k)
        rollouts, episodes = source.roll(state, prompts, index, k, [seed + i for i in mine])
        scores = np.zeros((0, len(self.reward_funcs)))  # a process with no prompts
        if len(index):
            scores = source.score(prompts, index, rollouts, episodes)
        sizes = [len(share) * k for share in shares]
        per_func = gather_shares(scores, sizes)
        lengths = gather_shares(rollouts.model_lengths.astype(np.float64), sizes)
        rewards = np.nansum(per_func * source.reward_weights, axis=1)
        passed = (rewards >= settings.task.eval_pass_threshold).reshape(len(prompts), k).any(1)
        logs = {
            "eval/reward": float(np.mean(rewards)),
            f"eval/pass@{k}": float(passed.mean()),
            "eval/completions/mean_length": float(np.mean(lengths)),
        }
        if source.tool_calls is not None:  # calls per episode and failed calls, all processes
            calls = gather_shares(rollouts.calls.astype(np.float64), sizes)
            failures = gather_shares(rollouts.failures.astype(np.float64), sizes)
            logs["eval/tools/calls_per_episode"] = float(calls.mean())
            logs["eval/tools/failures"] = float(failures.sum())
        for j, fn in enumerate(self.reward_funcs):
            if not np.isnan(per_func[:, j]).all():
                logs[f"eval/rewards/{reward_name(fn)}"] = float(np.nanmean(per_func[:, j]))
        return logs

    @staticmethod
    def _tool_calls(
        tools: Any, environment_factory: Any, settings: RunSettings, tokenizer: Any
    ) -> ToolCalls | None:
        """The run's tools (given, or loaded from the task's `tools` / `environment`), after
        checking that the chat template shows tool calls and that they can be parsed."""
        loaded = load_tools(
            settings.task.tools if tools is None else None,
            settings.task.environment if environment_factory is None else None,
        )
        tools = loaded[0] if tools is None else tools
        environment_factory = loaded[1] if environment_factory is None else environment_factory
        if not tools and environment_factory is None:
            return None
        check_tool_template(tokenizer)
        return ToolCalls(tools, environment_factory)

    @classmethod
    def _reward_funcs(
        cls, funcs: Any, settings: RunSettings, extra: list[Callable]
    ) -> list[Callable]:
        if funcs is None:
            funcs = [
                load_reward(s, format_pattern=settings.task.format_pattern)
                for s in settings.task.reward or []
            ]
        funcs = list(funcs) if isinstance(funcs, (list, tuple)) else [funcs]
        funcs += extra  # an environment's get_reward
        if not funcs:
            raise ArgumentError(
                f"{cls.__name__} needs reward functions: reward_funcs=[fn, ...] or "
                f"{cls.arguments_class.__name__}.reward (e.g. ['last_number_matches'] or "
                "['my_module:fn'])."
            )
        for fn in funcs:
            if not callable(fn):
                raise ArgumentError(f"reward function {fn!r} is not callable.")
        return funcs


def split_rollout_devices(
    settings: RunSettings, kwargs: Mapping[str, Any]
) -> tuple[Mesh | None, list[jax.Device] | None]:
    """With `rollout_devices` r: the mesh of the last r of the run's devices (`kwargs`'
    `devices=`, else all), where the engine samples, and the others, which train. Without:
    (None, None)."""
    r = settings.task.rollout_devices
    if not r:
        return None, None
    if kwargs.get("runtime") is not None:
        raise ArgumentError(
            f"rollout_devices={r} splits the devices itself: pass devices= (or none), not runtime=."
        )
    if jax.process_count() > 1:
        raise ArgumentError(
            f"rollout_devices={r}: a generation sub-mesh runs in one process for now; set "
            "rollout_devices=0 on several processes."
        )
    training, rollout = rollout_split(list(kwargs.get("devices") or jax.devices()), r)
    return Mesh(np.array(rollout), ("rollout",)), training


def check_process_groups(settings: RunSettings, processes: int) -> None:
    """On several processes each generates whole groups of its rows of every micro-batch."""
    if processes == 1:
        return
    if settings.task.max_staleness:
        raise ArgumentError(
            f"max_staleness={settings.task.max_staleness}: asynchronous rollouts run in one "
            f"process for now (this run has {processes}); set max_staleness=0, or run in one "
            "process."
        )
    micro = settings.data.global_batch_size // settings.data.accumulation_steps
    share, g = micro // processes, settings.task.num_generations
    if micro % processes or share % g:
        raise ArgumentError(
            f"GRPO on {processes} processes: each generates its share of every micro-batch "
            f"({micro} rows / {processes} processes = {micro / processes:g}), which must be "
            f"whole groups of num_generations={g}; make total_batch_size / "
            f"gradient_accumulation_steps a multiple of {processes * g}."
        )


def check_rollout_processes(
    settings: RunSettings, processes: int, tool_calls: ToolCalls | None
) -> None:
    """Rollout processes serve one trainer process, and sample single-turn rollouts (a
    multi-turn rollout's environments live in the trainer's process)."""
    if not settings.task.rollout_processes:
        return
    if processes > 1:
        raise ArgumentError(
            f"rollout_processes={settings.task.rollout_processes}: rollout processes serve a "
            f"trainer in one process (this run has {processes}); set rollout_processes=0."
        )
    if tool_calls is not None:
        raise ArgumentError(
            f"rollout_processes={settings.task.rollout_processes}: rollouts with tools run in the "
            "trainer's process (their environments and tools live there); set "
            "rollout_processes=0."
        )


def arguments_name(settings: RunSettings) -> str:
    """The arguments class a run's task section comes from (GRPOArguments), as errors name it."""
    return settings.task.arguments_class.__name__


def check_routing_replay(
    settings: RunSettings, routing: tuple[int, int] | None, tool_calls: ToolCalls | None
) -> None:
    """routing_replay needs a mixture-of-experts policy sampled in single turns (the engine
    records the experts of one request's tokens)."""
    if not settings.task.routing_replay:
        return
    if routing is None:
        raise ArgumentError(
            f"{arguments_name(settings)}.routing_replay replays a mixture-of-experts policy's "
            "expert choices; this policy has no experts: set routing_replay=False."
        )
    if tool_calls is not None:
        raise ArgumentError(
            f"{arguments_name(settings)}.routing_replay does not replay multi-turn tool rollouts "
            "yet (their turns are separate requests): set routing_replay=False, or drop tools."
        )


def grpo_objective(settings: RunSettings) -> Objective:
    """GRPO's objective for a run's settings (its task's loss type, beta, clipping): on a
    TaskModel whose `reference` is the frozen KL reference (None with LoRA: the policy
    without adapters)."""
    task = settings.task

    def loss_sums(model: TaskModel, batch: dict[str, jax.Array], rng: jax.Array):
        del rng
        ids, labels, t = batch["input_ids"], batch["labels"], task.temperature
        # A vision prompt's images (None for text prompts), seen by every model.
        seen = dict(temperature=t, pixel_values=batch.get("pixel_values"))
        # Log-probs of softmax(logits / temperature): the distribution the completions were
        # sampled from (TRL's too). The entropy comes out of the same (chunked) logits.
        # The policy's forward replays the sampler's experts (routing_replay; the reference
        # routes as it does).
        logps, mask, entropy = model_token_logps(
            model.model, ids, labels, entropy=True, routing=batch.get("routing"), **seen
        )
        ref = None
        if task.beta > 0:
            if model.reference is not None:
                ref, _ = model_token_logps(model.reference, ids, labels, **seen)
            else:  # LoRA: the base model is the policy without its adapters
                with adapters_off(model.model) as base:
                    ref, _ = model_token_logps(base, ids, labels, **seen)
            ref = jax.lax.stop_gradient(ref)
        sums = grpo_loss_sums(
            logps, batch.get("old_logps"), ref, batch["advantages"], mask,
            loss_type=task.loss_type, max_completion_length=task.max_completion_length,
            sampler_logps=batch.get("sampler_logps"), sampler_weight=batch.get("sampler_weight"),
            **loss_options(task),
        )  # fmt: skip
        mask = mask.astype(jnp.float32)
        tokens = sums["completion_tokens"]
        out = {
            "loss_sum": sums["loss_sum"],
            "tokens": loss_units(task.loss_type, mask).sum(),
            # KL, clip ratio and entropy: means over every completion token of the window, as
            # TRL logs them (whatever unit the loss is averaged over; the clip ratio over the
            # completions at the sequence level).
            "kl_sum": sums["token_kl_sum"],
            "kl_count": tokens,
            "entropy_sum": (jax.lax.stop_gradient(entropy) * mask).sum(),
            "entropy_count": tokens,
        }
        if "phi_sum" in sums:  # vespo's weight, a mean over completions (TRL's phi_seq_mean)
            out["vespo/phi_seq_mean_sum"] = sums["phi_sum"]
            out["vespo/phi_seq_mean_count"] = jnp.float32(mask.shape[0])
        clip_name = clip_metric_name(task.loss_type)  # none for sapo, cispo's own for cispo
        if clip_name is not None:
            out[f"{clip_name}_sum"] = sums["clipped_sum"]
            out[f"{clip_name}_count"] = sums["clipped_count"]
        return out

    def normalizer(batch: dict[str, jax.Array]) -> jax.Array:
        return grpo_normalizer(task.loss_type, batch["labels"][..., 1:] != IGNORE_INDEX)

    return Objective(loss_sums=loss_sums, normalizer=normalizer, token_nll=False)


def loss_options(task: Any) -> dict[str, Any]:
    """grpo_token_terms's keywords from GRPOArguments' section (clipping, KL, ratio level,
    sapo, mask)."""
    return {
        "beta": task.beta,
        "epsilon": task.epsilon,
        "epsilon_high": task.epsilon_high,
        "kl_ratio_weight": task.kl_ratio_weight,
        "importance_sampling_level": task.importance_sampling_level,
        "sapo_temperature_pos": task.sapo_temperature_pos,
        "sapo_temperature_neg": task.sapo_temperature_neg,
        "off_policy_mask_threshold": task.off_policy_mask_threshold,
        "delta": task.delta,
        "vespo": (task.vespo_k_pos, task.vespo_lambda_pos, task.vespo_k_neg,
                  task.vespo_lambda_neg),
    }  # fmt: skip


def loss_units(loss_type: str, mask: jax.Array) -> jax.Array:
    """Each row's weight in the unit the loss is averaged over ([B])."""
    if loss_type in ("dapo", "cispo", "vespo"):
        return mask.sum(-1)
    if loss_type == "bnpo":
        return mask.sum(-1) / jnp.maximum(mask.sum(), 1.0)
    return jnp.ones(mask.shape[0], jnp.float32)
