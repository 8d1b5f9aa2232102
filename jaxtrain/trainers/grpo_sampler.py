"""GRPO's completions: sampled on the engine (serving/), through tool calls when there are
tools (tool_rollouts.py), returned as RolloutRows.

The engine is made from the policy at the first round, compiles every bucket it can reach
then (`Engine.warm_up`; not for a run of one round, `warms_up`), and is handed the live
parameters before each round. A group of rollouts of one prompt is one request of num_generations samples: one prefill, its pages
shared. With tools, each rollout's next turn is a request of its own whose prompt is the
rollout so far: the engine keeps the finished turn's pages, so it prefills the tools' answer
only.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from flax import nnx

from jaxtrain.config.sections import RunSettings
from jaxtrain.serving import Completion, Engine, SamplingParams
from jaxtrain.serving.tool_chat import response_template
from jaxtrain.serving.warm_up import EngineShape
from jaxtrain.trainers.grpo_prompts import Prompts, chat_ids, observed_prompt
from jaxtrain.trainers.rollout_rows import MODEL, PAD, TOOL, RolloutRows
from jaxtrain.trainers.tool_rollouts import Episode, play_tool_turns
from jaxtrain.trainers.tools import ToolCalls

__all__ = ["RolloutSampler", "completion_logs", "rollout_engine_shape", "warms_up"]

# (prompt ids, samples, seed, max_tokens, the prompt's images or None) of one engine request.
Ask = tuple[Any, int, int, int, Any]


def rollout_engine_shape(settings: RunSettings) -> EngineShape:
    """The engine GRPO samples on: a slot per completion of an update, pages of 16 tokens,
    rows of a prompt and its completion (what `jaxtrain plan --task grpo` compiles too)."""
    task = settings.task
    return EngineShape(
        max_slots=settings.data.global_batch_size,
        page_size=16,
        max_length=task.max_prompt_length + task.max_completion_length,
        decode_steps=task.rollout_decode_steps,
    )


def warms_up(settings: RunSettings) -> bool:
    """Whether the engine compiles every shape before the first round: `rollout_warm_up`, or
    when it is None, unless the run trains a single round. A warm-up only moves compiles
    ahead so that later rounds wait on none; one round has no later round, and would also
    compile the shapes it never reaches (a 1-step GRPO command: 7 s instead of 12-19 s on 2
    CPU cores). A run by epochs (max_steps <= 0) warms up."""
    chosen = settings.task.rollout_warm_up
    if chosen is not None:
        return chosen
    return not 0 < settings.loop.max_steps <= settings.task.num_iterations


class RolloutSampler:
    """See the module docstring. `eos_token_ids` end a completion (the first fills the rest
    of its row, else `pad_token_id`); `prompt_sets` are every prompt this run
    samples (the warm-up compiles for the longest); `processes`: the processes sharing
    each round (each samples its share); `routing`: a MoE policy's routing shape
    (MoeConfig.routing_shape): the engine records each token's experts, returned with the
    rows (single-turn rollouts)."""

    def __init__(
        self,
        settings: RunSettings,
        tokenizer: Any,
        *,
        eos_token_ids: list[int],
        pad_token_id: int,
        prompt_sets: list[Prompts],
        processes: int,
        tool_calls: ToolCalls | None = None,
        routing: tuple[int, int] | None = None,
    ):
        self.settings, self.tokenizer, self.eos_token_ids = settings, tokenizer, eos_token_ids
        self.routing = routing
        self.pad_token_id, self.prompt_sets, self.processes = pad_token_id, prompt_sets, processes
        self.tool_calls = tool_calls
        self.template = response_template(tokenizer) if tool_calls is not None else None
        self.engine: Engine | None = None

    def load(self, policy: nnx.Module) -> None:
        """Sample from `policy` from now on (the engine is made at the first call)."""
        if self.engine is None:
            shape = rollout_engine_shape(self.settings)
            self.engine = Engine(
                policy,
                max_slots=shape.max_slots,
                page_size=shape.page_size,
                max_length=shape.max_length,
                decode_steps=shape.decode_steps,
                eos_token_ids=self.eos_token_ids,
                logprobs_mode="processed",  # scored as the trainer scores them
                max_images=self.settings.data.images_per_row,
                record_routing=self.routing is not None,
            )
            if warms_up(self.settings):
                self.engine.warm_up(*self._warm_up_limits())
        self.engine.update_state(nnx.split(policy)[1])

    def roll(
        self, prompts: Prompts, prompt_rows: np.ndarray, g: int, seeds: list[int]
    ) -> tuple[RolloutRows, list[Episode] | None]:
        """Completions of prompts[prompt_rows] (groups of `g` rows of one prompt; group p
        draws with seeds[p]). With tools, each rollout goes on through its tool calls and
        its episode comes back too. A completion is its tokens up to its end-of-sequence id
        or max_completion_length, with the sampler's log-prob of each (after the
        temperature)."""
        settings = self.settings
        ids = [prompts.ids[r] for r in prompt_rows]
        boxes = None
        if self.tool_calls is not None:
            boxes, seen = self.tool_calls.toolboxes([prompts.row(r) for r in prompt_rows])
            ids = [
                x if o is None else self._observed(prompts.values[r], o, box.tools)
                for x, r, o, box in zip(ids, prompt_rows, seen, boxes)
            ]
        asks: list[Ask] = []
        for p, seed in enumerate(seeds):
            group, most = ids[p * g : (p + 1) * g], settings.task.max_completion_length
            images = None if prompts.images is None else prompts.images[prompt_rows[p * g]]
            if all(np.array_equal(x, group[0]) for x in group):
                asks.append((group[0], g, seed, most, images))
            else:  # environments' observations made each rollout's prompt its own
                asks += [(x, 1, seed * g + i, most, None) for i, x in enumerate(group)]
        firsts = [c for group in self.run(asks) for c in group]
        fill = self.eos_token_ids[0] if self.eos_token_ids else self.pad_token_id
        out = RolloutRows.empty(
            len(ids),
            settings.task.max_prompt_length,
            settings.task.max_completion_length,
            fill,
            self.routing,
        )
        if boxes is None:
            for i, (prompt, c) in enumerate(zip(ids, firsts)):
                out.put(i, prompt, c.token_ids, c.logprobs, MODEL, c.routing)
            return out, None
        episodes = [
            Episode([int(t) for t in prompt], box, list(c.token_ids), list(c.logprobs))
            for prompt, box, c in zip(ids, boxes, firsts)
        ]
        play_tool_turns(
            episodes,
            self._next_turns,
            self.tokenizer,
            self.template,
            max_completion_length=settings.task.max_completion_length,
            max_iterations=settings.task.max_tool_calling_iterations,
            timeout=settings.task.tool_timeout,
            seed=lambda i, turn: (seeds[i // g] * 1_000_003 + (i % g) * 7_919 + turn + 1) % 2**31,
        )
        for i, e in enumerate(episodes):
            out.put(i, e.prompt, e.tokens, e.logprobs, np.where(e.from_model, MODEL, TOOL))
            out.calls[i], out.failures[i] = e.calls, e.failures
        return out, episodes

    def run(self, asks: list[Ask]) -> list[list[Completion]]:
        """Each request's completions, in the order of their index."""
        settings = self.settings
        ids = [
            self.engine.submit(
                prompt,
                SamplingParams(
                    max_tokens=most,
                    temperature=settings.task.temperature,
                    top_p=settings.task.top_p,
                    top_k=settings.task.top_k or 0,
                    seed=seed,
                ),  # fmt: skip
                n=n,
                images=images,
            )
            for prompt, n, seed, most, images in asks
        ]
        wanted = {i: ask[1] for i, ask in zip(ids, asks)}
        done: dict[int, list[Completion]] = {i: [] for i in ids}
        while any(len(done[i]) < wanted[i] for i in ids):
            for completion in self.engine.step():
                done[completion.request_id].append(completion)
        return [sorted(done[i], key=lambda c: c.index) for i in ids]

    def _next_turns(self, asks: list[tuple[list[int], int, int]]) -> list[tuple[list, list]]:
        """The next turn of each rollout (token ids so far, tokens it may add, seed)."""
        done = self.run([(ids, 1, seed, room, None) for ids, room, seed in asks])
        return [(group[0].token_ids, group[0].logprobs) for group in done]

    def _observed(self, messages: list, observation: str, tools: list) -> np.ndarray:
        """A prompt with its environment's observation, tokenized (left-cut to fit)."""
        tokens = chat_ids(self.tokenizer, observed_prompt(messages, observation), tools)
        return np.asarray(tokens[-self.settings.task.max_prompt_length :], np.int32)

    def _warm_up_limits(self) -> tuple[int, int]:
        """(the longest prompt, the most prompts one call submits) of the rounds and the
        evaluations on this process: the engine's warm-up compiles no shape beyond them."""
        settings = self.settings
        longest = max(len(ids) for prompts in self.prompt_sets for ids in prompts.ids)
        per_round = (
            settings.data.global_batch_size // self.processes // settings.task.num_generations
        )
        if self.tool_calls is not None:  # every rollout's next turn: its whole sequence so far
            longest = settings.task.max_prompt_length + settings.task.max_completion_length - 1
            per_round = settings.data.global_batch_size // self.processes
        # Evaluations: contiguous shares of the eval prompts, the first ones the larger.
        per_eval = max((-(-len(p) // self.processes) for p in self.prompt_sets[1:]), default=0)
        if self.tool_calls is not None:
            per_eval *= settings.task.eval_num_generations
        return longest, max(per_round, per_eval)


def completion_logs(rollouts: RolloutRows, ended: np.ndarray, tools: bool) -> dict[str, float]:
    """Completion lengths (the model's tokens, as TRL counts them) and, with tools, the
    calls per rollout, the share of calls that failed and the share of completion tokens
    the tools wrote."""
    lengths = rollouts.model_lengths
    logs = {
        "completions/mean_length": float(lengths.mean()),
        "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()),
        "completions/clipped_ratio": float((~ended).mean()),
    }
    if tools:
        calls = int(rollouts.calls.sum())
        logs["tools/call_frequency"] = calls / len(lengths)
        logs["tools/failure_frequency"] = float(rollouts.failures.sum()) / max(calls, 1)
        written = (rollouts.kind != PAD).sum()
        logs["tools/environment_token_share"] = float(
            (rollouts.kind == TOOL).sum() / max(written, 1)
        )
    return logs
