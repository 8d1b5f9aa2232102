"""The arguments of the online RL tasks: RolloutArguments (what GRPO and RLOO share: sampling,
rewards, tools, the rollout engine and its processes or devices), GRPOArguments, RLOOArguments.

Part of the configuration, like jaxtrain/task_arguments.py: it imports nothing of the
implementation, so the command line checks these fields before jax is touched.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jaxtrain.arguments import TrainingArguments
from jaxtrain.errors import ArgumentError, first_failed_check

__all__ = [
    "GRPO_IMPORTANCE_SAMPLING_LEVELS",
    "GRPO_LOSS_TYPES",
    "GRPO_SAMPLER_CORRECTIONS",
    "GRPO_SCALE_REWARDS",
    "GRPOArguments",
    "RLOOArguments",
    "RolloutArguments",
]

GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
GRPO_IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
GRPO_SCALE_REWARDS = ("group", "batch", "none")
# TRL's vllm_importance_sampling_mode values, and "none" (its correction off).
GRPO_SAMPLER_CORRECTIONS = (
    "none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"
)  # fmt: skip


@dataclasses.dataclass
class RolloutArguments(TrainingArguments):
    """What the online RL tasks (GRPO, RLOO) share: sampling completions of prompts, scoring
    them with reward functions, tools, evaluation. `total_batch_size` counts completions: each
    update sees total_batch_size / num_generations prompts, num_generations completions each.
    `max_sequence_length` is set to max_prompt_length + max_completion_length (a row)."""

    # Completions sampled per prompt (the group whose mean reward is the baseline); >= 2.
    num_generations: int = 8
    # Prompt tokens kept (the start is cut: the end of a prompt is what the answer follows).
    max_prompt_length: int = 256
    # New tokens sampled per completion at most.
    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    # Weight of the KL penalty to the reference (the start model; with LoRA, the base without
    # adapters). 0 keeps no reference at all.
    beta: float = 0.0
    # The ratio pi / pi_old is clipped to [1 - epsilon, 1 + epsilon_high].
    epsilon: float = 0.2
    # None: epsilon (DAPO's clip-higher sets e.g. 0.28). With loss_type="cispo" it is the cap
    # on the ratio itself (min(r, epsilon_high); ScaleRL recommends 5.0), as in TRL.
    epsilon_high: float | None = None
    # Updates per generated batch (the later ones are off-policy, with the old log-probs).
    num_iterations: int = 1
    # Asynchronous rollouts: the next rounds are sampled in the background while this one
    # trains, from the parameters of their time, at most this many rounds behind the policy
    # that trains on them (their ratio to the sampling policy corrects for it). 0: each round
    # sampled from the current parameters, then trained (synchronous).
    max_staleness: int = 0
    # Devices kept for generation: the last this many of the run's devices hold the engine
    # (the policy replicated on them, handed over by a device-to-device copy each round);
    # the rest train. 0: the engine samples on the training mesh.
    rollout_devices: int = 0
    # Processes of their own that sample the rollouts, each an engine with a copy of the policy
    # (sent when it changed) and a share of each round's groups; one that dies is started
    # again and asked again. 0: the engine runs in the trainer's process.
    rollout_processes: int = 0
    # Tokens each of the engine's decode calls draws per completion (serving/decoding.py): the
    # same completions, the host's work between steps paid once per k tokens.
    rollout_decode_steps: int = 1
    # Compile every engine shape the run's prompts can reach before the first round, so no
    # round compiles (a steady step time from step 2). False compiles each shape when a round
    # first reaches it: a sooner start, and no compile of shapes a short run never reaches.
    # None (default): true, unless the run trains a single round (max_steps <= num_iterations):
    # a warm-up spares the later rounds their compiles, and a single round has none.
    rollout_warm_up: bool | None = None
    # A mixture-of-experts policy: each forward of the loss routes every token to the experts
    # the sampler chose for it (recorded by the engine), weighted by the trainer's router, so
    # routing flips between sampler and trainer no longer change the log-probs (rollout
    # routing replay). Off: the agreement is still logged (sampling/routing_agreement/*).
    routing_replay: bool = False
    # Completions cut at max_completion_length (no eos) get no loss.
    mask_truncated_completions: bool = False
    # One weight per reward function (default all 1).
    reward_weights: list[float] | None = None
    # CLI: reward functions as module:function paths, or the built-ins "last_number_matches"
    # and "format_regex" (jaxtrain/trainers/rewards.py).
    reward: list[str] | None = None
    # The pattern of the built-in format_regex reward (fullmatch of the completion).
    format_pattern: str | None = None
    # Evaluation (dataset_eval: prompts, every eval_steps): k completions per prompt, their
    # rewards logged, and pass@k: the share of prompts with at least one completion whose
    # weighted reward reaches eval_pass_threshold.
    eval_num_generations: int = 4
    eval_pass_threshold: float = 1.0
    # CLI: tools the model may call, as module:function paths (Python: GRPOTrainer(tools=)).
    tools: list[str] | None = None
    # CLI: an environment class as module:Class (Python: GRPOTrainer(environment_factory=)).
    environment: str | None = None
    # Rounds of tool calls per rollout at most (TRL's max_tool_calling_iterations); None: as
    # many as fit in max_completion_length.
    max_tool_calling_iterations: int | None = None
    # Seconds a tool call may take before the model is answered with a timeout error; None:
    # no limit (TRL has none; a hung tool would then stop the run).
    tool_timeout: float | None = 60.0

    def __post_init__(self) -> None:
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        if isinstance(self.tools, str):
            self.tools = [t.strip() for t in self.tools.split(",") if t.strip()]
        # A row is a prompt then its completion: the length the step is compiled for.
        self.max_sequence_length = self.max_prompt_length + self.max_completion_length
        if isinstance(self.reward, str):
            self.reward = [r.strip() for r in self.reward.split(",") if r.strip()]
        first_failed_check(type(self).__name__, [*self.task_checks(), *self._rollout_checks()])
        if self.packing:
            raise ArgumentError(
                f"{type(self).__name__}.packing: rollout rows cannot be packed; set packing=False."
            )
        super().__post_init__()

    def task_checks(self) -> list[tuple[bool, str]]:
        """The (ok, message) checks of a subclass's own fields, said first."""
        return []

    def _rollout_checks(self) -> list[tuple[bool, str]]:
        return [
            (
                self.max_tool_calling_iterations is None or self.max_tool_calling_iterations >= 0,
                f"max_tool_calling_iterations={self.max_tool_calling_iterations!r} must be None "
                "(no limit) or >= 0",
            ),
            (
                self.tool_timeout is None or self.tool_timeout > 0,
                f"tool_timeout={self.tool_timeout!r} must be None (no limit) or seconds > 0",
            ),
            (
                isinstance(self.num_generations, int) and self.num_generations >= 2,
                f"num_generations={self.num_generations!r}: a group needs at least 2 completions "
                "(its mean is the baseline); set num_generations >= 2",
            ),
            (
                self.total_batch_size % max(self.num_generations, 1) == 0,
                f"total_batch_size={self.total_batch_size} counts completions and must be a "
                f"multiple of num_generations={self.num_generations} (prompts x group)",
            ),
            (self.max_prompt_length >= 1, "max_prompt_length must be >= 1"),
            (self.max_completion_length >= 1, "max_completion_length must be >= 1"),
            (self.temperature > 0, f"temperature must be > 0 (sampling), got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (
                self.top_k is None or self.top_k >= 1,
                f"top_k must be None or >= 1, got {self.top_k}",
            ),
            (self.beta >= 0, f"beta must be >= 0, got {self.beta}"),
            (self.epsilon >= 0 and self.epsilon_high >= 0, "epsilon and epsilon_high must be >= 0"),
            (self.num_iterations >= 1, f"num_iterations must be >= 1, got {self.num_iterations}"),
            (
                isinstance(self.rollout_devices, int) and self.rollout_devices >= 0,
                f"rollout_devices={self.rollout_devices!r} must be an integer >= 0 (0: the "
                "engine samples on the training devices)",
            ),
            (
                isinstance(self.rollout_processes, int) and self.rollout_processes >= 0,
                f"rollout_processes={self.rollout_processes!r} must be an integer >= 0 (0: the "
                "engine samples in the trainer's process)",
            ),
            (
                not (self.rollout_processes and self.rollout_devices),
                f"rollout_processes={self.rollout_processes} and rollout_devices="
                f"{self.rollout_devices}: sample either in processes of their own or on devices "
                "of the trainer's; set one of them to 0",
            ),
            (
                isinstance(self.rollout_decode_steps, int) and self.rollout_decode_steps >= 1,
                f"rollout_decode_steps={self.rollout_decode_steps!r} must be an integer >= 1",
            ),
            (
                isinstance(self.max_staleness, int) and self.max_staleness >= 0,
                f"max_staleness={self.max_staleness!r} must be an integer >= 0 (0: synchronous)",
            ),
            (
                1 <= self.eval_num_generations <= self.total_batch_size,
                f"eval_num_generations={self.eval_num_generations} must lie in [1, "
                f"total_batch_size={self.total_batch_size}] (the engine's slots)",
            ),
        ]


@dataclasses.dataclass
class GRPOArguments(RolloutArguments):
    """GRPO (online RL from reward functions): RolloutArguments and GRPO's objective."""

    # The KL term times the ratio pi / pi_old (TRL's use_bias_correction_kl, its default):
    # an unbiased KL gradient on reused batches; False: the plain k3 estimator.
    kl_ratio_weight: bool = True
    # "token": one ratio per token; "sequence" (GSPO): one per completion, exp of the mean
    # log-ratio over its tokens, clipped as one (GSPO's paper pairs it with loss_type="grpo").
    importance_sampling_level: str = "token"
    # loss_type="sapo": the gate's temperature for tokens of positive advantage (TRL's default).
    sapo_temperature_pos: float = 1.0
    # loss_type="sapo": the gate's temperature for the other tokens (TRL's default).
    sapo_temperature_neg: float = 1.05
    # DeepSeek-V3.2's off-policy sequence mask: a completion with a negative advantage whose
    # mean (old - new) log-prob over its tokens exceeds this gets no policy loss. None: off.
    off_policy_mask_threshold: float | None = None
    # Correct for the sampler drawing from another distribution than the trainer scores
    # (TRL's vllm_importance_sampling_mode; "none" is its correction off): each completion
    # token's loss is weighted by exp(trainer - sampler log-prob), per token ("token_*") or
    # per completion ("sequence_*": the sum over its tokens), clipped to [min, max]
    # ("*_truncate") or zeroed outside it ("*_mask"); the off-policy mask then reads the
    # sampler's log-probs. The engine samples from the trainer's own parameters, so in a
    # synchronous float32 run the weight is 1 up to rounding (sampling/sampling_logp_difference
    # on every run's logs says how far): it pays when the sampler's weights differ.
    sampler_correction: str = "none"
    # sampler_correction's lower bound C_min (TRL's vllm_importance_sampling_clip_min); None: none.
    sampler_correction_min: float | None = None
    # sampler_correction's upper bound C_max (TRL's vllm_importance_sampling_clip_max, 3.0).
    sampler_correction_max: float | None = 3.0
    # DAPO's dynamic sampling: a group whose rewards are all equal has no signal (advantage
    # 0), so it is replaced by a group of another prompt, sampled again; up to this many more
    # passes per round (0: off). Groups still equal after the last pass train as they are.
    dynamic_sampling_passes: int = 0
    # The policy term and how token losses are averaged: docs/tasks.md "GRPO" (grpo, bnpo,
    # dr_grpo, dapo, cispo, sapo, luspo, vespo).
    loss_type: str = "dapo"
    # INTELLECT-2's two-sided clip for the clipped losses: the unclipped ratio is also capped
    # at delta (> 1 + epsilon_high), so a negative advantage cannot push it without bound.
    # None: off (TRL's default).
    delta: float | None = None
    # loss_type="vespo": its weight's exponent k and decay lambda for advantages >= 0 and for
    # negative ones (TRL's defaults).
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    # Advantages: reward minus the group mean, divided by the group's std ("group"), the
    # batch's ("batch") or not at all ("none", Dr. GRPO).
    scale_rewards: str = "group"

    def task_checks(self) -> list[tuple[bool, str]]:
        return [
            (
                self.loss_type in GRPO_LOSS_TYPES,
                f"loss_type={self.loss_type!r} is not one of {GRPO_LOSS_TYPES}",
            ),
            (
                self.importance_sampling_level in GRPO_IMPORTANCE_SAMPLING_LEVELS,
                f"importance_sampling_level={self.importance_sampling_level!r} is not one of "
                f"{GRPO_IMPORTANCE_SAMPLING_LEVELS}",
            ),
            (
                self.sapo_temperature_pos > 0,
                f"sapo_temperature_pos={self.sapo_temperature_pos!r} must be > 0 (the sapo gate "
                "divides by it; TRL's default 1.0)",
            ),
            (
                self.sapo_temperature_neg > 0,
                f"sapo_temperature_neg={self.sapo_temperature_neg!r} must be > 0 (the sapo gate "
                "divides by it; TRL's default 1.05)",
            ),
            (
                self.off_policy_mask_threshold is None or self.off_policy_mask_threshold >= 0,
                f"off_policy_mask_threshold={self.off_policy_mask_threshold!r} must be None (off) "
                "or >= 0 (a KL threshold, e.g. 0.5)",
            ),
            (
                self.sampler_correction in GRPO_SAMPLER_CORRECTIONS,
                f"sampler_correction={self.sampler_correction!r} is not one of "
                f"{GRPO_SAMPLER_CORRECTIONS}",
            ),
            (
                None in (self.sampler_correction_min, self.sampler_correction_max)
                or self.sampler_correction_min <= self.sampler_correction_max,
                f"sampler_correction_min={self.sampler_correction_min!r} is above "
                f"sampler_correction_max={self.sampler_correction_max!r}",
            ),
            (
                self.loss_type != "cispo" or self.epsilon_high > 0,
                f"epsilon_high={self.epsilon_high!r}: with loss_type='cispo' it caps the ratio "
                "and must be > 0 (TRL recommends 5.0)",
            ),
            (
                self.delta is None or self.delta > 1 + self.epsilon_high,
                f"delta={self.delta!r} must be None (off) or above 1 + epsilon_high="
                f"{1 + self.epsilon_high:g} (the cap of the unclipped ratio)",
            ),
            (
                self.loss_type != "vespo"
                or self.sampler_correction in ("none", "token_truncate", "token_mask"),
                f"sampler_correction={self.sampler_correction!r}: loss_type='vespo' takes a "
                "token-level one (token_truncate, token_mask), as TRL",
            ),
            (
                self.scale_rewards in GRPO_SCALE_REWARDS,
                f"scale_rewards={self.scale_rewards!r} is not one of {GRPO_SCALE_REWARDS}",
            ),
            (
                isinstance(self.dynamic_sampling_passes, int) and self.dynamic_sampling_passes >= 0,
                f"dynamic_sampling_passes={self.dynamic_sampling_passes!r} must be an integer "
                ">= 0 (0: off)",
            ),
        ]


@dataclasses.dataclass
class RLOOArguments(RolloutArguments):
    """RLOO (REINFORCE leave-one-out; Ahmadian et al. 2024) as TRL 1.16's RLOOTrainer: each
    completion's baseline is the mean reward of the other completions of its prompt; the KL to
    the reference is a penalty on the reward (not a loss term); one clipped ratio per
    completion. The defaults are TRL's (num_generations 2, beta 0.05)."""

    num_generations: int = 2
    # The KL penalty's weight: reward - beta x sum over the completion of (log pi_old - log
    # pi_ref), the log-probs taken when it was sampled. 0 keeps no reference.
    beta: float = 0.05
    # Advantages divided by their std over the whole batch (after their mean is taken out).
    normalize_advantages: bool = False
    # [low, high]: the weighted reward is clipped to it before the KL penalty; None: not.
    reward_clip_range: list[float] | None = None
    # RLOO has no dynamic sampling and no sampler correction (TRL's RLOOTrainer neither); the
    # rollout source reads them.
    dynamic_sampling_passes: ClassVar[int] = 0
    sampler_correction: ClassVar[str] = "none"
    sampler_correction_min: ClassVar[float | None] = None
    sampler_correction_max: ClassVar[float | None] = None

    def task_checks(self) -> list[tuple[bool, str]]:
        clip = self.reward_clip_range
        return [
            (
                clip is None or (len(clip) == 2 and float(clip[0]) <= float(clip[1])),
                f"reward_clip_range={clip!r} must be None or [low, high] with low <= high",
            ),
        ]
