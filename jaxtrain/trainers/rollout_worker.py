"""A rollout process (`rollout_processes` > 0): an engine of its own, in a process of its own,
sampling GRPO's completions for the trainer (rollout_processes.py starts it).

`python -m jaxtrain.trainers.rollout_worker FD`: FD is its end of a socket pair, over which
it receives pickled messages and answers each one:
- `("setup", Setup)`: the sampler's settings, the prompts, the policy's graph and its
  unchanging part (a LoRA or QLoRA base, buffers). Answer: `("ready", pid)`.
- `("roll", params or None, prompt_set, prompt_rows, group, seeds)`: the completions of those
  prompts (RolloutSampler.roll) from the policy with these parameters (None: the last ones
  sent). Answer: `("rows", RolloutRows)`.
- `("stop",)`, or the trainer's end of the socket closing: the process exits.
A Python error while sampling is answered `("error", traceback)`; the trainer raises it.
"""

from __future__ import annotations

import os
import sys
import traceback
from multiprocessing.connection import Connection

import jax
from flax import nnx

from jaxtrain.trainers.grpo_sampler import RolloutSampler

__all__ = ["serve"]


class _Rollouts:
    """This process's sampler, set up by the trainer's first message."""

    def __init__(self) -> None:
        self.setup, self.sampler, self.rest = None, None, None

    def answer(self, message: tuple) -> tuple:
        if message[0] == "setup":
            self.setup = setup = message[1]
            self.rest = jax.device_put(setup.rest)  # on this process's first device
            self.sampler = RolloutSampler(
                setup.settings,
                setup.tokenizer,
                eos_token_ids=setup.eos_token_ids,
                pad_token_id=setup.pad_token_id,
                prompt_sets=setup.prompt_sets,
                processes=setup.share,
                routing=setup.routing,
            )
            return ("ready", os.getpid())
        _, params, prompt_set, prompt_rows, group, seeds = message
        if params is not None:  # new parameters: the engine samples from them now
            self.sampler.load(nnx.merge(self.setup.graphdef, jax.device_put(params), self.rest))
        prompts = self.setup.prompt_sets[prompt_set]
        return ("rows", self.sampler.roll(prompts, prompt_rows, group, seeds)[0])


def serve(connection: Connection) -> None:
    """Answer the trainer's messages until it stops this process or goes away."""
    rollouts = _Rollouts()
    while True:
        try:
            message = connection.recv()
            if message[0] == "stop":
                return
            try:
                reply = rollouts.answer(message)
            except Exception:  # the trainer raises it, with this process's traceback
                reply = ("error", traceback.format_exc())
            connection.send(reply)
        except (EOFError, OSError):  # the trainer's process ended
            return


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])))
