"""A GRPO round's completions on the host, row by row, and the train rows made of them.

Each row is a prompt and a completion of at most max_completion_length tokens. `kind` says
what each completion position holds: the model's token (MODEL), a tool's (TOOL: a tool's
answer appended in a multi-turn rollout, never trained on) or nothing (PAD, after the end).
A single-turn completion ends at its first end-of-sequence id; a multi-turn one holds the
end-of-turn ids of its earlier turns too, so the end is read from `kind`, not the ids.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxtrain.data.collate import IGNORE_INDEX

__all__ = ["MODEL", "PAD", "TOOL", "RolloutRows"]

PAD, MODEL, TOOL = 0, 1, 2


@dataclasses.dataclass
class RolloutRows:
    """Prompts [N, P] (their lengths [N]: an environment's observation can make a row's
    prompt its own), completions [N, C], their sampler log-probs and kinds, and each row's
    tool calls and failed calls; of a mixture-of-experts policy, `routing` [N, S, P + C, k]:
    the experts the sampler sent each token of the row (prompt then completion) to in its S
    sparse layers (-1: not run through the model, as a completion's last token)."""

    prompt_ids: np.ndarray
    prompt_lengths: np.ndarray
    tokens: np.ndarray
    logprobs: np.ndarray
    kind: np.ndarray
    calls: np.ndarray
    failures: np.ndarray
    routing: np.ndarray | None = None

    @classmethod
    def empty(
        cls,
        rows: int,
        prompt_length: int,
        length: int,
        fill: int,
        routing: tuple[int, int] | None = None,
    ) -> RolloutRows:
        """`routing`: a MoE policy's (sparse layers, experts per token), or None."""
        return cls(
            np.zeros((rows, prompt_length), np.int32),
            np.zeros(rows, np.int32),
            np.full((rows, length), fill, np.int32),
            np.zeros((rows, length), np.float32),
            np.zeros((rows, length), np.int8),
            np.zeros(rows, np.int32),
            np.zeros(rows, np.int32),
            None if routing is None else np.full(
                (rows, routing[0], prompt_length + length, routing[1]), -1, np.int16
            ),
        )  # fmt: skip

    def put(self, row: int, prompt, tokens, logprobs, kind, routing=None) -> None:
        """Row `row`: its prompt, its completion's tokens, their log-probs and kinds (and the
        experts of the tokens the sampler ran, [S, tokens, k])."""
        p, n = len(prompt), len(tokens)
        self.prompt_ids[row, :p], self.prompt_lengths[row] = prompt, p
        self.tokens[row, :n], self.logprobs[row, :n], self.kind[row, :n] = tokens, logprobs, kind
        if routing is not None:
            self.routing[row, :, : routing.shape[1]] = routing

    def prompt(self, row: int) -> np.ndarray:
        return self.prompt_ids[row, : self.prompt_lengths[row]]

    def arrays(self) -> dict[str, np.ndarray]:
        """Every array held (`routing` only of a MoE policy)."""
        fields = (f.name for f in dataclasses.fields(self))
        return {name: getattr(self, name) for name in fields if getattr(self, name) is not None}

    def select(self, index: np.ndarray) -> RolloutRows:
        return RolloutRows(**{k: v[index] for k, v in self.arrays().items()})

    def assign(self, index: np.ndarray, other: RolloutRows) -> None:
        for name, values in other.arrays().items():
            getattr(self, name)[index] = values

    @property
    def lengths(self) -> np.ndarray:
        """Each completion's length: its last token is its end (an end id, or the cut)."""
        real = self.kind != PAD
        return np.where(real.any(1), real.shape[1] - real[:, ::-1].argmax(1), 0)

    def ended(self, eos_token_ids: list[int]) -> np.ndarray:
        """Whether each completion ended by itself (its last token an end id), not cut."""
        last = self.tokens[np.arange(len(self.tokens)), np.maximum(self.lengths - 1, 0)]
        return np.isin(last, eos_token_ids) & (self.lengths > 0)

    @property
    def model_lengths(self) -> np.ndarray:
        """The model's own tokens of each completion (TRL's completion lengths)."""
        return (self.kind == MODEL).sum(1)

    def texts(self, tokenizer: Any) -> list[str]:
        return tokenizer.batch_decode(
            [row[:n].tolist() for row, n in zip(self.tokens, self.lengths)],
            skip_special_tokens=True,
        )

    def train_rows(
        self,
        scored: np.ndarray,
        advantages: np.ndarray,
        *,
        sequence_length: int,
        pad_token_id: int,
        accumulation: int,
    ) -> dict[str, np.ndarray]:
        """[A, M, T] rows: prompt then completion, right-padded (causal attention never lets
        a real token see the padding); labels are the model's tokens of the scored
        completions; the sampler's log-probs [A, M, T - 1] where the trainer's log-prob of
        each token is; a MoE sampler's routing [A, M, S, T, k]."""
        n, t = len(self.tokens), sequence_length
        ids = np.full((n, t), pad_token_id, np.int32)
        labels = np.full((n, t), IGNORE_INDEX, np.int32)
        sampler = np.zeros((n, t - 1), np.float32)
        for i, c in enumerate(self.lengths):
            p = self.prompt(i)
            tokens, start = self.tokens[i, :c], len(p)
            ids[i, :start], ids[i, start : start + c] = p, tokens
            sampler[i, start - 1 : start - 1 + c] = self.logprobs[i, :c]
            if scored[i]:
                labels[i, start : start + c] = np.where(self.kind[i, :c] == MODEL, tokens,
                                                        IGNORE_INDEX)  # fmt: skip
        host = {"input_ids": ids, "labels": labels, "advantages": advantages,
                "sampler_logps": sampler}  # fmt: skip
        if self.routing is not None:  # rows start with their prompt, as the sampler's record
            host["routing"] = self.routing[:, :, :t]
        return {
            k: v.reshape(accumulation, n // accumulation, *v.shape[1:]) for k, v in host.items()
        }
