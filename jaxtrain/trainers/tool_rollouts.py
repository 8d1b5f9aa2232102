"""Multi-turn rollouts: the model calls tools, their answers are appended, it goes on.

Token in, token out. A rollout's completion is one token sequence: the model's first turn
(as sampled), then for each round of tool calls the tools' answers as the chat template
writes them (tool_chat.tool_suffix_ids) and the model's next turn, sampled from the whole
sequence so far. Nothing is decoded and tokenized again, so the tokens trained on are the
tokens sampled; the engine finds the sequence's pages in its cache and prefills only the
answer. The answer tokens are marked as not the model's: they get no loss and no KL.

The rules are TRL's GRPOTrainer (1.16) tool loop's: at most `max_iterations` rounds of calls;
the whole completion, answers included, stays within `max_completion_length` (answers that
would pass it are not appended and the rollout ends there; the last turn is cut to fit); a
failed call is answered with its error. A malformed call (a tool call the parser cannot read)
is answered with the parser's error too, where TRL ends the rollout on it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jaxtrain.serving.tool_chat import ToolTurn, parse_turn, tool_suffix_ids
from jaxtrain.trainers.tools import Toolbox

__all__ = ["Episode", "Generate", "play_tool_turns"]

# (token ids so far, tokens it may add, seed) of each rollout that goes on -> for each, the
# tokens sampled and their log-probs.
Generate = Callable[[list[tuple[list[int], int, int]]], list[tuple[list[int], list[float]]]]


@dataclasses.dataclass
class Episode:
    """One rollout: its prompt, then the completion's tokens, whether each is the model's,
    the sampler's log-prob of each (0 for the tools' tokens) and the conversation parsed."""

    prompt: list[int]
    toolbox: Toolbox
    tokens: list[int]
    logprobs: list[float]
    from_model: list[bool] = dataclasses.field(default_factory=list)
    messages: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    calls: int = 0
    failures: int = 0
    turn: ToolTurn | None = None  # the newest model turn, parsed

    def __post_init__(self) -> None:
        if not self.from_model:
            self.from_model = [True] * len(self.tokens)


def play_tool_turns(
    episodes: list[Episode],
    generate: Generate,
    tokenizer: Any,
    template: dict[str, Any],
    *,
    max_completion_length: int,
    max_iterations: int | None,
    timeout: float | None,
    seed: Callable[[int, int], int],
) -> None:
    """Runs every episode's tool calls and further turns (in place) from its first turn;
    `seed(episode index, round)` seeds a turn's draws."""
    for episode in episodes:
        episode.turn = _parse(episode, tokenizer, template, len(episode.tokens))
        episode.messages.append(episode.turn.message)
    going = [i for i, e in enumerate(episodes) if _wants_tools(e.turn)]
    rounds = 0
    while going and (max_iterations is None or rounds < max_iterations):
        fits = []
        for i in going:
            episode = episodes[i]
            answers = _answer(episode, timeout)
            suffix = tool_suffix_ids(tokenizer, answers)
            if len(episode.tokens) + len(suffix) > max_completion_length:
                continue  # its answers do not fit: the rollout ends with its call
            episode.messages += answers
            episode.tokens += suffix
            episode.from_model += [False] * len(suffix)
            episode.logprobs += [0.0] * len(suffix)
            fits.append(i)
        asks = [(i, max_completion_length - len(episodes[i].tokens)) for i in fits]
        asks = [(i, room) for i, room in asks if room > 0]
        outputs = generate(
            [(episodes[i].prompt + episodes[i].tokens, room, seed(i, rounds)) for i, room in asks]
        )
        going = []
        for (i, _), (tokens, logprobs) in zip(asks, outputs):
            episode, start = episodes[i], len(episodes[i].tokens)
            episode.tokens += list(tokens)
            episode.from_model += [True] * len(tokens)
            episode.logprobs += list(logprobs)
            if tokens:
                episode.turn = _parse(episode, tokenizer, template, len(episode.tokens) - start)
                episode.messages.append(episode.turn.message)
                if _wants_tools(episode.turn):
                    going.append(i)
        rounds += 1


def _wants_tools(turn: ToolTurn) -> bool:
    return bool(turn.calls) or turn.malformed is not None


def _parse(episode: Episode, tokenizer: Any, template: dict[str, Any], newest: int) -> ToolTurn:
    """The episode's newest `newest` tokens, parsed as a model turn."""
    cut = len(episode.tokens) - newest
    return parse_turn(
        tokenizer,
        template,
        episode.tokens[cut:],
        episode.prompt + episode.tokens[:cut],
        episode.toolbox.tools,
    )


def _answer(episode: Episode, timeout: float | None) -> list[dict[str, Any]]:
    """The tool messages answering the episode's newest turn (counted, failures too)."""
    turn = episode.turn
    if turn.malformed is not None:
        episode.calls += 1
        episode.failures += 1
        error = {"error": f"malformed tool call: {turn.malformed}"}
        return [{"role": "tool", "name": "unknown", "content": str(error)}]
    answers = []
    for call in turn.calls:
        name, content, failed = episode.toolbox.call(call, timeout)
        episode.calls += 1
        episode.failures += failed
        answers.append({"role": "tool", "name": name, "content": content})
    return answers
