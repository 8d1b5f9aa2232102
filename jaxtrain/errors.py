"""Every error jaxtrain raises on purpose, in one family.

A leaf module: it imports nothing from jaxtrain, so any module may raise these without an
import circle. Each error carries the exit code `jaxtrain` ends with when it escapes a
command (the CLI catches `JaxtrainError` once). The classes stay importable from the
modules that raise them (jaxtrain.arguments.ArgumentError, jaxtrain.parallel.MeshError...).

Bad-input errors also subclass ValueError and runtime failures RuntimeError, so code that
caught the built-in types before this family existed keeps working.
"""

from __future__ import annotations

import signal

# Exit codes of `jaxtrain`, one per way a run can end (documented in docs/checkpoints.md, "Exit codes").
EXIT_OK = 0
EXIT_CRASH = 1
EXIT_BAD_INPUT = 2
EXIT_TIME_LIMIT = 3  # stopped at training_time_limit after saving: rerun to continue
EXIT_NONFINITE = 4  # the loss became NaN/Inf (on_nan="stop" or too many skips)
EXIT_PEER_LOST = 5  # multi-host: another process died or hung (parallel/peers.py): restart all
EXIT_OUT_OF_MEMORY = 6  # a step ran out of device memory: change a setting (the line names some)
# A signal ends the run with 128 + its number, as shells report it: 130 SIGINT, 143 SIGTERM.

__all__ = [
    "first_failed_check",
    "EXIT_BAD_INPUT",
    "EXIT_CRASH",
    "EXIT_NONFINITE",
    "EXIT_OK",
    "EXIT_OUT_OF_MEMORY",
    "EXIT_PEER_LOST",
    "EXIT_TIME_LIMIT",
    "ArgumentError",
    "CheckpointError",
    "DatasetError",
    "DistributedError",
    "HFError",
    "JaxtrainError",
    "MeshError",
    "NonFiniteLossError",
    "ObjectiveError",
    "OutOfMemoryError",
    "ReportError",
    "RewardError",
    "RolloutProcessError",
    "ShardingRuleError",
    "TaskError",
    "TrackerError",
    "TrainingInterrupted",
    "first_sentences",
]


class JaxtrainError(Exception):
    """Base of every error jaxtrain raises on purpose; `exit_code` is what the CLI exits with."""

    exit_code: int = EXIT_CRASH


# ------------------------------------------------------------------ bad input (exit 2)
class ArgumentError(JaxtrainError, ValueError):
    """An invalid TrainingArguments value; the message names the field and the fix."""

    exit_code = EXIT_BAD_INPUT


class MeshError(ArgumentError):
    """`sharding_axis_dims` does not fit the devices; the message says why and how to fix it."""


class ShardingRuleError(ArgumentError):
    """A sharding rule does not fit a parameter; the message names it, its shape and the axes."""


class TrackerError(ArgumentError):
    """A tracker named in report_to cannot start; the message says why and how to fix it."""


class TaskError(ArgumentError):
    """An evaluation task (eval_tasks, `jaxtrain evaluate --tasks`) cannot run: its file, its
    data or a feature it needs; the message names the task and the fix."""


class DatasetError(JaxtrainError, ValueError):
    """A dataset cannot be used as given; the message names the dataset, file/row/column and fix."""

    exit_code = EXIT_BAD_INPUT


class HFError(JaxtrainError, ValueError):
    """A Hugging Face directory, config or weight file jaxtrain cannot load or write.

    The message names the file, the field or tensor, and how to fix it.
    """

    exit_code = EXIT_BAD_INPUT


class RewardError(JaxtrainError, ValueError):
    """A reward function (GRPO, RLOO) raised or returned something unusable; the message names
    the function and what it got (a column it needs that the data lacks, a wrong length)."""

    exit_code = EXIT_BAD_INPUT


class CheckpointError(JaxtrainError, RuntimeError):
    """A checkpoint that cannot be written where asked, or cannot be read back."""

    exit_code = EXIT_BAD_INPUT


class DistributedError(JaxtrainError, RuntimeError):
    """The multi-host cluster could not be formed; the message says what and how to fix it."""

    exit_code = EXIT_BAD_INPUT


class RolloutProcessError(JaxtrainError, RuntimeError):
    """A rollout process (GRPO's rollout_processes) kept dying, or raised while sampling."""

    exit_code = EXIT_PEER_LOST


class ObjectiveError(JaxtrainError, TypeError):
    """A loss function broke the objective contract (jaxtrain/objective.py): the
    message names the missing or malformed key. Raised when the step is traced."""

    exit_code = EXIT_BAD_INPUT


# ------------------------------------------------------------------ a run that ended early
class NonFiniteLossError(JaxtrainError, RuntimeError):
    """The loss or the gradients became NaN/Inf; the offending update was not applied."""

    exit_code = EXIT_NONFINITE


class OutOfMemoryError(JaxtrainError, RuntimeError):
    """A step (or its compile) ran out of device memory. The message gives what the
    compiled step needs, what was free, the settings found to fit (`fits`, when searched)
    and the device-memory profile written at the failure."""

    exit_code = EXIT_OUT_OF_MEMORY

    def __init__(
        self,
        step: int,
        cause: str,
        *,
        needed_bytes: float | None = None,
        temporaries_bytes: float | None = None,
        free_bytes: float | None = None,
        profile: str | None = None,
        fits: list[str] | None = None,
    ):
        self.step, self.cause, self.profile = step, cause, profile
        self.needed_bytes, self.free_bytes, self.fits = needed_bytes, free_bytes, fits
        self.temporaries_bytes = temporaries_bytes  # of the step, within needed_bytes
        super().__init__(self._message())

    def with_fits(self, fits: list[str]) -> OutOfMemoryError:
        """The same error, naming the settings found to fit."""
        return OutOfMemoryError(
            self.step,
            self.cause,
            needed_bytes=self.needed_bytes,
            temporaries_bytes=self.temporaries_bytes,
            free_bytes=self.free_bytes,
            profile=self.profile,
            fits=fits,
        )

    def _message(self) -> str:
        # `step`: the last step whose results were read; with asynchronous dispatch a
        # later one may be the one that failed.
        line = f"the train step ran out of device memory after step {self.step} ({self.cause})"
        if self.needed_bytes is not None:
            line += (
                f": it needs {_mib(self.needed_bytes)} per device (XLA's memory analysis, the "
                "figure `jaxtrain plan` predicts)"
            )
            if self.free_bytes is not None:
                line += f" and about {_mib(self.free_bytes)} were free for it"
        if self.fits:
            line += "; one change each, compiled: " + "; ".join(self.fits)
        else:
            line += (
                "; lower the memory per device with gradient_checkpointing, more fsdp in "
                "sharding_axis_dims or more gradient_accumulation_steps (`jaxtrain plan "
                "--sweep` compares meshes)"
            )
        if self.profile:
            line += f"; device memory profile: {self.profile} (pprof)"
        return line + "."


def _mib(value: float) -> str:
    return f"{value / 2**30:.2f} GiB" if value >= 2**30 else f"{value / 2**20:.1f} MiB"


class ReportError(JaxtrainError, RuntimeError):
    """run_report=True and the report could not be written (the training itself finished)."""

    exit_code = EXIT_CRASH


class TrainingInterrupted(JaxtrainError):
    """SIGINT or SIGTERM arrived; the step in flight finished and a checkpoint was saved.

    Not a failure: the CLI prints the message without "error:" and exits 128 + the signal's
    number, as shells report a signal.
    """

    def __init__(self, signal_name: str, step: int, checkpoint_path: str | None):
        self.signal_name, self.step, self.checkpoint_path = signal_name, step, checkpoint_path
        self.exit_code = 128 + int(getattr(signal, signal_name))
        where = f"checkpoint {checkpoint_path}" if checkpoint_path else "no checkpoint"
        super().__init__(
            f"{signal_name} received: stopped after step {step} and saved {where}. "
            "Run the same command again to resume."
        )

    def __reduce__(self) -> tuple:  # pickled whole: a Ray actor's run raises it to the driver
        return type(self), (self.signal_name, self.step, self.checkpoint_path)


def first_failed_check(owner: str, checks: list[tuple[bool, str]]) -> None:
    """ArgumentError for the first failed (ok, message) of `checks`, named `owner.field...`
    (the arguments classes' checks: each message starts with its field)."""
    for ok, message in checks:
        if not ok:
            raise ArgumentError(f"{owner}.{message}.")


def first_sentences(text: str, limit: int = 240) -> str:
    """`text`'s first line, cut after its last whole sentence within `limit` characters: a
    library's long reason quoted in one of our lines, never cut mid-word."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    line = lines[0] if lines else ""
    if len(line) <= limit:
        return line
    end = line.rfind(". ", 0, limit)
    return line[: end + 1] if end > 0 else line[:limit] + "..."
