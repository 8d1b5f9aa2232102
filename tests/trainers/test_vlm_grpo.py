"""GRPO on image prompts (issue 50, Gemma 3): the engine samples each group's completions with
its prompt's images, and the trainer scores them with the same images: the sampler's and the
trainer's log-probs of every sampled token agree (they would not if either side lost the
images); a reward that reads a column of the row trains; a prompt longer than
max_prompt_length with an image is refused, not cut."""

from __future__ import annotations

import datasets
import numpy as np
import pytest
from vlm_fixtures import picture, write_checkpoint

from jaxtrain.data.errors import DatasetError
from jaxtrain.hf import AutoModelForCausalLM, load_tokenizer
from jaxtrain.trainers import GRPOArguments, GRPOTrainer, RLOOArguments, RLOOTrainer

COLOURS = ["red", "blue", "green"]


def says_the_colour(prompts, completions, colour, **_):
    return [float(c in text) for c, text in zip(colour, completions)]


class Logs:
    def __init__(self) -> None:
        self.logs: list[dict[str, float]] = []

    def on_log(self, trainer, logs, step) -> None:
        self.logs.append(dict(logs))


def rows(n: int = 8) -> list[dict]:
    return [{"images": [picture(i, 20 + 3 * i, 28)], "colour": COLOURS[i % 3],
             "prompt": [{"role": "user", "content": "what colour is this picture"}]}
            for i in range(n)]  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("vlm_grpo") / "base", seed=2)


@pytest.mark.parametrize("trainer, arguments", [(GRPOTrainer, GRPOArguments),
                                                (RLOOTrainer, RLOOArguments)])  # fmt: skip
def test_sampler_and_trainer_see_the_same_images(checkpoint, tmp_path, trainer, arguments):
    logs = Logs()
    args = arguments(
        output_dir=str(tmp_path / "run"), max_steps=2, total_batch_size=8, num_generations=4,
        max_prompt_length=24, max_completion_length=4, learning_rate=1e-2, beta=0.04,
        logging_steps=1, progress_bar="none", run_report=False, save_final=False,
    )  # fmt: skip
    run = trainer(
        arguments=args, model=AutoModelForCausalLM.from_pretrained(str(checkpoint)),
        reward_funcs=[says_the_colour], dataset_train=datasets.Dataset.from_list(rows()),
        processing_class=load_tokenizer(checkpoint), callbacks=[logs],
    )  # fmt: skip
    assert run.train_source.prompts.image_shape == (3, 32, 32)
    run.train()
    steps = [x for x in logs.logs if "sampling/sampling_logp_difference/max" in x]
    assert len(steps) == 2 and all(np.isfinite(x["loss"]) for x in steps)
    # Sampler (engine, with the prompt's images) and trainer (its forward, with the same
    # images in the batch's slots) give each sampled token the same log-prob.
    assert max(x["sampling/sampling_logp_difference/max"] for x in steps) < 1e-4


def test_an_image_prompt_past_max_prompt_length_is_refused(checkpoint, tmp_path):
    args = GRPOArguments(output_dir=str(tmp_path / "run"), max_steps=1, total_batch_size=8,
                         num_generations=4, max_prompt_length=8, max_completion_length=4)  # fmt: skip
    with pytest.raises(DatasetError, match="row 0: the prompt has .* tokens with its images"):
        GRPOTrainer(
            arguments=args, model=AutoModelForCausalLM.from_pretrained(str(checkpoint)),
            reward_funcs=[says_the_colour], dataset_train=datasets.Dataset.from_list(rows()),
            processing_class=load_tokenizer(checkpoint),
        )  # fmt: skip
