"""Which prompts each GRPO step trains on: a loader with the train loader's interface that
hands out prompt rows only, as a pure function of the seed and the step (so a resumed run
regenerates from the same prompts)."""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxtrain.data.errors import DatasetError
from jaxtrain.data.units import epoch_order

__all__ = ["PromptLoader"]


class PromptLoader:
    """Which dataset rows are the prompts of each step: a shuffled epoch order (seed, epoch),
    one round of `prompts` rows per num_iterations steps. Has the train loader interface
    the loop and checkpoints use."""

    state_is_per_process = False

    def __init__(
        self,
        num_rows: int,
        prompts: int,
        num_iterations: int,
        seed: int,
        shuffle: bool,
        group: int = 1,
        accumulation: int = 1,
    ):
        if num_rows < prompts:
            raise DatasetError(
                f"dataset_train has {num_rows} prompts but one update needs {prompts} "
                "(total_batch_size / num_generations); lower total_batch_size or add prompts"
            )
        self.num_rows, self.prompts, self.num_iterations = num_rows, prompts, num_iterations
        self.seed, self.shuffle = seed, shuffle
        self.group, self.accumulation = group, accumulation
        self.rounds_per_epoch = num_rows // prompts
        # Host batches handed out, by step: the trainer puts the generated rows in them, so
        # the loop's throughput counts the completions (not the prompt rows) of each step.
        self.handed_out: dict[int, dict[str, Any]] = {}

    @property
    def steps_per_epoch(self) -> int:
        return self.rounds_per_epoch * self.num_iterations

    def epoch(self, step: int) -> float:
        return step / self.steps_per_epoch

    def rows_at(self, step: int) -> np.ndarray:
        epoch, within = divmod(step // self.num_iterations, self.rounds_per_epoch)
        order = epoch_order(self.num_rows, seed=self.seed, epoch=epoch, shuffle=self.shuffle)
        return order[within * self.prompts : (within + 1) * self.prompts].astype(np.int32)

    def data_state(self, step: int) -> dict[str, Any]:
        return {"kind": "grpo_prompts", "step": int(step), "seed": self.seed,
                "num_rows": self.num_rows, "prompts": self.prompts}  # fmt: skip

    def check_data_state(self, state: dict[str, Any]) -> int:
        mine = self.data_state(state.get("step", 0))
        changed = [k for k in mine if k != "step" and state.get(k) != mine[k]]
        if changed:
            raise DatasetError(
                f"the checkpoint's prompt order differs in {changed} (saved {state}, now "
                f"{mine}); resume with the same dataset, seed and batch sizes"
            )
        return int(state["step"])

    def batches(self, start_step: int = 0, *, with_stats: bool = False):
        step = start_step
        while True:  # the loop swaps this for the generated batch (GRPOTrainer.on_batch)
            # One entry per completion, [A, M] like the train batch: it splits over the
            # mesh's data axes whenever the generated batch does.
            rows = np.repeat(self.rows_at(step), self.group)
            batch = {"prompt_rows": rows.reshape(self.accumulation, -1)}
            self.handed_out[step] = batch
            yield (batch, None) if with_stats else batch
            step += 1
