"""GRPO's batches: an on-policy batch source (jaxtrain.data.batch_source) of scored rollouts.

Each round (num_iterations updates) takes total_batch_size / num_generations prompts
(PromptLoader: a pure function of seed and step), samples num_generations completions of each
from the live parameters the loop hands to `next(step, state)` (`serving.Engine`, on the run's
mesh or on devices of its own), scores them with the reward functions on the host, turns the
rewards into advantages per group and lays the rows out as the train step's batch (with dynamic
sampling, a group whose rewards are all equal is first replaced by a group of another prompt,
drawn by seed and round, in up to dynamic_sampling_passes more passes). The later updates of a
round reuse its batch (with the log-probs of the policy that sampled it); a checkpoint inside a
round keeps the batch (grpo_round.py, through `checkpoint_extra`), so a resume is exact. With
tools (GRPOTrainer's `tools`, `environment_factory`) a rollout goes on through its tool calls,
the tools' answers appended to its tokens and masked out of the loss (grpo_sampler.py,
tool_rollouts.py, rollout_rows.py). The train step's shapes are fixed (a row is a prompt of at
most max_prompt_length tokens, then its completion, right-padded to their sum), so it compiles
once; the engine compiles every bucket of its prefill and decode steps when it is made, before
the first round samples (`Engine.warm_up`), and nothing after (a run of one round, or
`rollout_warm_up=False`: each when first reached; grpo_sampler.warms_up).

With max_staleness k > 0 the rounds after the current one are sampled in the background
while it trains, from copies of the parameters of their time (rounds_ahead.py); their batches
carry that policy's log-probs as the old ones.

On several processes each generates the completions of its own rows of every micro-batch
(whole groups: the layout's contiguous share of each micro-batch) on an engine of its own,
over a process-local copy of the policy, and scores them; the tokens and rewards are then
gathered so that every process computes the same advantages and logs. A prompt's draws
depend only on the round's seed and the prompt's place in the round, so the completions are
those one process would sample.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxtrain.config.sections import RunSettings
from jaxtrain.data.batch_source import SourceBatch
from jaxtrain.data.meter import DataMeter
from jaxtrain.parallel.batch import BatchLayout
from jaxtrain.parallel.process_local import (
    gather_micro_batch_shares,
    micro_batch_share,
    process_local_state,
)
from jaxtrain.serving import Engine
from jaxtrain.trainers.grpo_loss import group_advantages
from jaxtrain.trainers.grpo_prompts import PromptLoader, Prompts
from jaxtrain.trainers.grpo_round import GeneratedRound, rollout_batch
from jaxtrain.trainers.grpo_sampler import RolloutSampler, completion_logs
from jaxtrain.trainers.rewards import reward_name, score_completions
from jaxtrain.trainers.rollout_processes import RolloutProcesses
from jaxtrain.trainers.rollout_rows import RolloutRows
from jaxtrain.trainers.round_logps import RoundLogps
from jaxtrain.trainers.rounds_ahead import RoundsAhead
from jaxtrain.trainers.tool_rollouts import Episode
from jaxtrain.trainers.tools import ToolCalls

__all__ = ["RolloutSource", "rollout_batch"]

logger = logging.getLogger("jaxtrain.trainers.grpo")


class RolloutSource:
    """See the module docstring. `reward_funcs` with their `reward_weights`; `eos_token_ids`
    end a completion; `layout` places the batch on the mesh; prompts are left-padded with
    `pad_token_id`; `routing`: a mixture-of-experts policy's routing shape
    (MoeConfig.routing_shape): the sampler records its experts, their agreement with the
    trainer's is logged, and with routing_replay the loss replays them."""

    on_policy = True
    state_is_per_process = False

    def __init__(
        self,
        settings: RunSettings,
        prompts: Prompts,
        *,
        tokenizer: Any,
        reward_funcs: Sequence[Callable],
        reward_weights: np.ndarray,
        layout: BatchLayout,
        pad_token_id: int,
        eos_token_ids: list[int],
        eval_prompts: Prompts | None = None,
        tool_calls: ToolCalls | None = None,
        rollout_mesh: Any = None,
        routing: tuple[int, int] | None = None,
    ):
        self.settings, self.prompts, self.tokenizer = settings, prompts, tokenizer
        self.eval_prompts = eval_prompts  # sampled by GRPOTrainer.evaluate on this engine
        self.reward_funcs, self.reward_weights = list(reward_funcs), reward_weights
        self.layout, self.pad_token_id, self.eos_token_ids = layout, pad_token_id, eos_token_ids
        self.order = PromptLoader(
            len(prompts),
            settings.data.global_batch_size // settings.task.num_generations,
            settings.task.num_iterations,
            settings.data.seed,
            settings.data.shuffle,
            group=settings.task.num_generations,
            accumulation=settings.data.accumulation_steps,
        )
        self.meter = DataMeter()  # nothing is truncated or padded by a collator here
        self.last_completions: list[str] = []  # the newest round's, for inspection
        self._program: Any = None
        self._round: GeneratedRound | None = None  # the batch the current round's steps reuse
        self._last_batch_time: float | None = None
        self.logps = RoundLogps(settings, layout)  # the trainer's log-probs of a round
        self.process_index, self.process_count = jax.process_index(), layout.process_count
        self._local_rest: Any = None  # the policy's frozen part on this process's devices
        # A mesh of devices of its own for the engine (rollout_devices), or None.
        self.rollout_mesh = rollout_mesh
        self.sampler = RolloutSampler(
            settings,
            tokenizer,
            eos_token_ids=eos_token_ids,
            pad_token_id=pad_token_id,
            prompt_sets=[prompts] + ([eval_prompts] if eval_prompts is not None else []),
            processes=self.process_count,
            tool_calls=tool_calls,
            routing=routing,
        )
        self.routing = routing  # a MoE policy's routing shape: its agreement is measured
        self.rollout_workers: RolloutProcesses | None = None  # rollout_processes > 0
        if settings.task.rollout_processes:
            self.rollout_workers = RolloutProcesses(settings.task.rollout_processes, self.sampler)
        self.tool_calls = tool_calls
        self._episodes: dict[int, Episode] = {}  # this round's multi-turn rollouts, by row
        self.ahead: RoundsAhead | None = None  # max_staleness > 0: rounds sampled ahead
        if settings.task.max_staleness > 0:
            steps, n = settings.loop.max_steps, settings.task.num_iterations
            last = (steps - 1) // n if steps > 0 else None
            self.ahead = RoundsAhead(self._sample_round, settings.task.max_staleness, last)

    @property
    def engine(self) -> Engine | None:
        """The engine the rollouts are sampled on (made at the first round)."""
        return self.sampler.engine

    @property
    def program(self) -> Any:
        """The Program whose parameters the rollouts sample from (set by `open`)."""
        return self._program

    @property
    def sequence_length(self) -> int:
        return self.settings.task.max_prompt_length + self.settings.task.max_completion_length

    # ------------------------------------------------------------ the protocol
    @property
    def steps_per_epoch(self) -> int:
        return self.order.steps_per_epoch

    def epoch(self, step: int) -> float:
        return self.order.epoch(step)

    def data_state(self, step: int) -> dict[str, Any]:
        return self.order.data_state(step)

    def check_data_state(self, state: dict[str, Any]) -> int:
        return self.order.check_data_state(state)

    def open(self, start_step: int, program: Any) -> None:
        """Sample from `program`'s model from `start_step` on (a resumed round's batch, if
        the checkpoint kept one, arrived through `resume_extra`)."""
        del start_step
        self._program, self._last_batch_time = program, None

    def close(self) -> None:
        self._last_batch_time = None
        if self.ahead is not None:
            self.ahead.close()
        if self.rollout_workers is not None:
            self.rollout_workers.close()

    def settle(self) -> None:
        """Wait for the rounds sampled in the background (before the engine samples anything
        else: evaluation)."""
        if self.ahead is not None:
            self.ahead.rounds()

    def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        """The generated train batch's shapes, dtypes and shardings ([A, M, ...] global)."""
        return {
            k: jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=self.layout.sharding(x.ndim, micro_axis=True)
            )
            for k, x in rollout_batch(self.settings, self.prompts.image_shape, self.routing).items()
        }

    def next(self, step: int, state: Any) -> SourceBatch:
        """`step`'s batch: the current round's, or a new round sampled from `state`."""
        # The previous update may still run (async dispatch): wait for it, so its time counts
        # as training, not as this step's generation (which needs its parameters anyway).
        jax.block_until_ready(state.params)
        now = time.perf_counter()
        logs: dict[str, float] = {}
        if self._last_batch_time is not None:  # the previous step's rest: its update
            logs["time/training_s"] = now - self._last_batch_time
        n = self.settings.task.num_iterations
        generation = step // n
        if self._round is None and step % n:
            # Resumed inside a round from a checkpoint that does not keep its batch (see
            # resume_extra): said, not hidden.
            logger.warning(
                "GRPO resumed at step %d, inside a round of num_iterations=%d updates, from a "
                "checkpoint that does not hold the round's generated batch (written by an "
                "older jaxtrain, or with another num_iterations): its completions are sampled "
                "again (same key) from the resumed parameters, and the rest of this round "
                "differs from an uninterrupted run.",
                step,
                n,
            )
        generation_s = 0.0
        if self._round is None or self._round.generation != generation:
            ready, generation_s = self.ahead.take(generation) if self.ahead else (None, 0.0)
            if ready is None:  # sampled now, from `state`
                ready = self._sample_round(state, generation, generation)
                generation_s = ready.logs["time/generation_s"]
            self._round, self.last_completions = ready, ready.completions
            if self.ahead is not None:  # the next rounds, sampled while this one trains
                logs["async/weight_handoff_s"] = self.ahead.launch(state, generation)
        self._last_batch_time = time.perf_counter()
        current = self._round
        # The host rows are the completions: the loop counts their tokens for throughput.
        return SourceBatch(
            host=dict(current.host),
            batch=current.batch,
            logs={**current.logs, **logs, "time/generation_s": generation_s},
        )

    def checkpoint_extra(self, step: int) -> tuple[dict[str, Any], Any] | None:
        """Inside a round (step `step` reuses the batch of the steps before it): the round's
        batch and logs, so a resume finishes the round exactly; and the rounds sampled ahead
        (waited for). At a boundary of a synchronous run: nothing."""
        n, current = self.settings.task.num_iterations, self._round
        inside = current is not None and step % n != 0 and current.generation == step // n
        ahead = self.ahead.rounds() if self.ahead is not None else []
        if not ahead:
            return current.checkpoint(n) if inside else None
        return GeneratedRound.checkpoint_rounds([current] * inside + ahead, n)

    def resume_extra(
        self, details: dict[str, Any], restore: Callable[[Any], Any], step: int
    ) -> None:
        """The round a checkpoint kept becomes the current one (the next steps reuse it), and
        the rounds it sampled ahead the ones to come; rounds of another num_iterations are
        left unread."""
        n = self.settings.task.num_iterations
        if details.get("num_iterations") != n:
            return
        rounds = GeneratedRound.restored_rounds(details, restore, self.abstract_batch())
        generation, inside = step // n, step % n != 0
        for kept in rounds:
            if inside and kept.generation == generation:
                self._round, self.last_completions = kept, kept.completions
        ahead = [r for r in rounds if r.generation > generation - (not inside)]
        if ahead and self.ahead is None:
            logger.warning(
                "the checkpoint holds %d rounds sampled ahead (max_staleness > 0); this run "
                "has max_staleness=0, so they are sampled again from the resumed parameters.",
                len(ahead),
            )
        elif ahead:
            self.ahead.restore(ahead)

    # ------------------------------------------------------------ rollouts
    def sampling_key(self, step: int) -> jax.Array:
        """The key of the completions of `step`'s round: a function of the seed and the
        round only, so a resumed run samples what the uninterrupted one did."""
        return jax.random.fold_in(
            jax.random.key(self.settings.data.seed), step // self.settings.task.num_iterations
        )

    def _sample_round(self, state: Any, generation: int, launched_at: int) -> GeneratedRound:
        """Round `generation`, sampled from `state` (a copy of the parameters of the round
        `launched_at` when sampled ahead: its staleness is the difference)."""
        start = self.settings.task.num_iterations * generation
        placed, logs, host, texts = self._generate(state, start)
        if self.ahead is not None:
            logs["async/staleness"] = float(generation - launched_at)
            logs["async/sampling_s"] = logs["time/generation_s"]
        return GeneratedRound(generation, placed, logs, texts, host)

    def generate_batch(
        self, state: Any, step: int
    ) -> tuple[dict[str, jax.Array], dict[str, float], dict[str, np.ndarray]]:
        """The scored completions of `step`'s prompts as a global train batch, its logs, and
        this process's input_ids and labels on the host. With dynamic sampling, the groups
        whose rewards are all equal are replaced by groups of other prompts, pass by pass.
        `last_completions` become its completions."""
        placed, logs, host, self.last_completions = self._generate(state, step)
        return placed, logs, host

    def _generate(
        self, state: Any, step: int
    ) -> tuple[dict[str, jax.Array], dict[str, float], dict[str, np.ndarray], list[str]]:
        settings, g = self.settings, self.settings.task.num_generations
        rows = np.repeat(self.order.rows_at(step), g)  # each prompt's group, together
        n = len(rows)
        mine = self.local_rows(np.arange(n))  # the round's rows this process generates
        # This process's rows: their completions, sampler log-probs and reward columns.
        start = time.perf_counter()
        here = self.sample(state, rows, mine, step)
        generation_s = time.perf_counter() - start
        scores_here = self._score(rows, mine, here)
        per_func = self.gather_rows(scores_here)
        rewards, advantages, equal = self._advantages(per_func)
        used, replaced, passes = set(rows.tolist()), 0, 0
        for attempt in range(1, settings.task.dynamic_sampling_passes + 1):
            groups = np.flatnonzero(equal[::g])  # every process finds the same ones
            fresh = self.order.refill_rows(step, attempt, len(groups), np.asarray(sorted(used)))
            if not len(groups) or not len(fresh):
                break
            groups = groups[: len(fresh)]
            rows[(groups[:, None] * g + np.arange(g)).ravel()] = np.repeat(fresh, g)
            used.update(fresh.tolist())
            again = np.isin(mine // g, groups)  # this process's rows of those groups
            start = time.perf_counter()
            here.assign(again, self.sample(state, rows, mine[again], step, attempt))
            generation_s += time.perf_counter() - start
            scores_here[again] = self._score(rows, mine[again], here.select(again))
            per_func = self.gather_rows(scores_here)
            rewards, advantages, equal = self._advantages(per_func)
            replaced, passes = replaced + len(groups), attempt
        every = RolloutRows(**{k: self.gather_rows(v) for k, v in here.arrays().items()})
        ended = every.ended(self.eos_token_ids)
        scored = ~(~ended & settings.task.mask_truncated_completions)
        texts = every.texts(self.tokenizer)
        host = every.train_rows(
            scored,
            advantages,
            sequence_length=self.sequence_length,
            pad_token_id=self.pad_token_id,
            accumulation=settings.data.accumulation_steps,
        )
        if self.prompts.image_shape is not None:  # the prompts' images, for the forward
            slots = self.prompts.image_slots(rows, settings.data.images_per_row)
            host["pixel_values"] = slots.reshape(
                settings.data.accumulation_steps, -1, *slots.shape[1:]
            )
        host = {k: self.local_rows(v, micro_axis=True) for k, v in host.items()}
        placed = self.layout.to_global(host, micro_axis=True)
        # The trainer's log-probs of the tokens just sampled, from the parameters that sampled
        # them: the later updates' old log-probs, and what the sampler's are compared with.
        trainer_logps = self.logps.trainer(self._program, state, placed)
        equal, penalty_logs = self.final_advantages(state, placed, trainer_logps, rewards, equal)
        sampler_logps = placed.pop("sampler_logps")
        if (
            settings.task.num_iterations > 1 or settings.task.max_staleness > 0
        ):  # later updates (or rounds) compare with it
            placed["old_logps"] = trainer_logps
        labels = placed["labels"]
        weight, agreement_logs = self.logps.agreement(trainer_logps, sampler_logps, labels)
        if "routing" in placed:  # a MoE policy: the trainer's routing against the sampler's
            agreement_logs.update(self.logps.routing(self._program, state, placed))
            if not settings.task.routing_replay:
                del placed["routing"]
        if settings.task.sampler_correction != "none":
            placed["sampler_logps"], placed["sampler_weight"] = sampler_logps, weight
        logs = {
            "reward": float(np.nanmean(rewards)),
            "reward_std": float(np.nanstd(rewards, ddof=1)) if n > 1 else 0.0,
            "frac_reward_zero_std": float(equal.reshape(-1, g)[:, 0].mean()),
            **completion_logs(every, ended, tools=self.tool_calls is not None),
            "time/generation_s": generation_s,
            **agreement_logs,
            **penalty_logs,
        }
        if self.rollout_workers is not None:  # the weight handoff to the processes
            logs["rollout/weight_send_s"] = self.rollout_workers.last_send_s
        if settings.task.dynamic_sampling_passes:
            logs["dynamic_sampling/replaced_groups"] = float(replaced)
            logs["dynamic_sampling/passes"] = float(passes)
        for j, fn in enumerate(self.reward_funcs):
            column = per_func[:, j]
            if not np.isnan(column).all():
                logs[f"rewards/{reward_name(fn)}"] = float(np.nanmean(column))
        return placed, logs, {k: host[k] for k in ("input_ids", "labels")}, texts

    def final_advantages(
        self,
        state: Any,
        placed: dict[str, jax.Array],
        trainer_logps: jax.Array,
        rewards: np.ndarray,
        equal: np.ndarray,
    ) -> tuple[np.ndarray, dict[str, float]]:
        """Advantages that need the round's log-probs (RLOO's KL-penalized reward) replace
        `placed["advantages"]` here; returns (each group's rewards all equal [N], logs). GRPO's
        are final before the rows are placed."""
        del state, placed, trainer_logps, rewards
        return equal, {}

    def _score(self, rows: np.ndarray, positions: np.ndarray, rollouts: RolloutRows) -> np.ndarray:
        """The reward functions' values [len(positions), functions] of the completions
        `rollouts` of the round's rows at `positions` (NaN: a function did not score one)."""
        if not len(positions):
            return np.zeros((0, len(self.reward_funcs)))
        episodes = [self._episodes[int(p)] for p in positions] if self.tool_calls else None
        return self.score(self.prompts, rows[positions], rollouts, episodes)

    def score(
        self,
        prompts: Prompts,
        prompt_rows: np.ndarray,
        rollouts: RolloutRows,
        episodes: list[Episode] | None,
    ) -> np.ndarray:
        """The reward functions' values [N, functions] of `rollouts`, the completions of
        prompts[prompt_rows]. After tools, reward functions also receive each conversation
        (`completion_messages`: the model's turns and the tools' answers, TRL's completions)
        and, with an environment_factory, the rollouts' `environments`."""
        columns = {k: [v[r] for r in prompt_rows] for k, v in prompts.columns.items()}
        if episodes is not None:
            columns["completion_messages"] = [e.messages for e in episodes]
            if self.tool_calls.factories:
                columns["environments"] = [e.toolbox.environment for e in episodes]
        return score_completions(
            self.reward_funcs,
            [prompts.values[r] for r in prompt_rows],
            rollouts.texts(self.tokenizer),
            columns,
        )

    def weighted_rewards(self, per_func: np.ndarray) -> np.ndarray:
        """Each completion's weighted reward [N]: NaN where no function scored it."""
        rewards = np.nansum(per_func * self.reward_weights, axis=1)
        rewards[np.isnan(per_func).all(1)] = np.nan
        return rewards

    def _advantages(self, per_func: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(weighted rewards, NaN where no function scored; advantages; group all equal)."""
        rewards = self.weighted_rewards(per_func)
        advantages, equal = group_advantages(rewards, self.settings.task.num_generations,
                                             self.settings.task.scale_rewards)  # fmt: skip
        return rewards, advantages, equal

    # ------------------------------------------------------------ processes
    def local_rows(self, rows: np.ndarray, *, micro_axis: bool = False) -> np.ndarray:
        """This process's share of a round's rows (parallel/process_local.py)."""
        a = self.settings.data.accumulation_steps
        return micro_batch_share(rows, a, self.process_index, self.process_count,
                                 micro_axis=micro_axis)  # fmt: skip

    def gather_rows(self, local: np.ndarray) -> np.ndarray:
        """The round's rows [N, ...] in batch order from every process's `local_rows`."""
        a = self.settings.data.accumulation_steps
        return gather_micro_batch_shares(local, a, self.process_count)

    def sample(
        self, state: Any, rows: np.ndarray, mine: np.ndarray, step: int, attempt: int = 0
    ) -> RolloutRows:
        """The completions of the round's rows at positions `mine` (whole groups of
        num_generations) from the live parameters, on the engine (serving/). The prompt at
        place j of the round draws with the round's seed + j, whichever process samples it;
        dynamic sampling's pass `attempt` with other seeds (the round's seed + attempt x
        groups)."""
        g = self.settings.task.num_generations
        round_seed = int(jax.random.randint(self.sampling_key(step), (), 0, 2**31 - 1))
        seeds = [round_seed + attempt * (len(rows) // g) + i // g for i in mine[::g]]
        out, episodes = self.roll(state, self.prompts, rows[mine], g, seeds)
        for position, episode in zip(mine, episodes or []):
            self._episodes[int(position)] = episode
        return out

    def roll(
        self, state: Any, prompts: Prompts, prompt_rows: np.ndarray, g: int, seeds: list[int]
    ) -> tuple[RolloutRows, list[Episode] | None]:
        """RolloutSampler.roll from `state`'s policy. On several processes, on this
        process's devices only (every process calls it at the same point: the policy's copy
        is gathered); with a rollout mesh, on its devices (the policy copied there, replicated:
        the handoff; its frozen part once); with rollout processes, in them."""
        policy = self._program.model_from_state(state)
        if self.rollout_workers is not None:
            which = self.sampler.prompt_sets.index(prompts)
            return self.rollout_workers.roll(policy, which, prompt_rows, g, seeds), None
        if self.rollout_mesh is not None:
            graphdef, params, rest = nnx.split(policy, nnx.Param, ...)
            everywhere = NamedSharding(self.rollout_mesh, PartitionSpec())
            if self._local_rest is None:
                self._local_rest = jax.device_put(rest, everywhere)
            policy = nnx.merge(graphdef, jax.device_put(params, everywhere), self._local_rest)
        elif self.process_count > 1:
            # Trained parameters are gathered every round; the rest (a LoRA or QLoRA base,
            # buffers) never changes, so once.
            graphdef, params, rest = nnx.split(policy, nnx.Param, ...)
            if self._local_rest is None:
                self._local_rest = process_local_state(rest, self.layout.mesh)
            params = process_local_state(params, self.layout.mesh)
            policy = nnx.merge(graphdef, params, self._local_rest)
        self.sampler.load(policy)
        return self.sampler.roll(prompts, prompt_rows, g, seeds)
