"""The progress watch of a multi-host run: whose training loop stands still (step_timeout_s).

A process can be alive (its heartbeat goes on) and still stop the run: a collective that
never returns on one rank (jax-ml/jax 38503), a data loader deadlocked on one host. The
others then wait for it inside the next step's collectives, so every loop stands still,
and the one to name is the one furthest behind.

Each process counts the events of its training loop (`Position.count`): a step is
dispatched (the first one counts once it has run: its first execution is start-up), a hook
(evaluation, save) starts and ends, the loop ends.
The loop runs the same events in the same order on every process (same steps, same
cadences, agreed stops), so counts compare across processes where clocks do not. The
process with the lowest count is the one the others wait for. It is stuck when it is
stepping (not starting up, evaluating or saving, which take as long as they take) and its
count has not moved for `timeout_s`. Times are this process's clock: when it first saw a
count.
"""

from __future__ import annotations

import dataclasses

PHASES = ("start", "step", "hook", "end")


@dataclasses.dataclass(frozen=True)
class Position:
    """Where one process's training loop is."""

    count: int = 0  # loop events so far
    step: int = 0  # training steps done
    phase: str = "start"  # one of PHASES

    def encode(self) -> str:
        return f"{self.count}:{self.step}:{self.phase}"

    @staticmethod
    def decode(text: str) -> Position | None:
        """The position in `text`, or None when it is not one (a peer of another version)."""
        count, _, rest = text.partition(":")
        step, _, phase = rest.partition(":")
        if not (count.isdigit() and step.lstrip("-").isdigit() and phase in PHASES):
            return None
        return Position(int(count), int(step), phase)


@dataclasses.dataclass(frozen=True)
class Stuck:
    """A process whose loop stands still: at `position` for `still_s`."""

    process: int
    position: Position
    still_s: float


class ProgressBoard:
    """Every process's loop position and when this process first saw it."""

    def __init__(self, num_processes: int, timeout_s: float | None, now: float):
        self.timeout_s = timeout_s
        self.positions: dict[int, tuple[Position, float]] = {
            p: (Position(), now) for p in range(num_processes)
        }

    def advance(self, process: int, step: int, phase: str, now: float) -> Position:
        """Process `process` (this one) reached the next event of its loop."""
        if phase not in PHASES:
            raise ValueError(f"progress phase {phase!r} is not one of {PHASES}")
        old, _ = self.positions[process]
        new = Position(old.count + 1, step, phase)
        self.positions[process] = (new, now)
        return new

    def see(self, process: int, position: Position, now: float) -> None:
        """A peer's position, as read from its heartbeat."""
        if self.positions[process][0] != position:
            self.positions[process] = (position, now)

    def restart(self, now: float) -> None:
        """Every still count restarts from now (this process itself stood still)."""
        self.positions = {p: (pos, now) for p, (pos, _) in self.positions.items()}

    def stuck(self, now: float) -> list[Stuck]:
        """The processes the others wait for, when they stand still while stepping."""
        if self.timeout_s is None:
            return []
        live = {p: v for p, v in self.positions.items() if v[0].phase != "end"}
        if not live:
            return []
        lowest = min(pos.count for pos, _ in live.values())
        behind = {p: v for p, v in live.items() if v[0].count == lowest}
        if any(pos.phase != "step" for pos, _ in behind.values()):
            return []  # starting up, evaluating or saving: no step is due
        return [
            Stuck(p, pos, now - since)
            for p, (pos, since) in sorted(behind.items())
            if now - since >= self.timeout_s
        ]

    def furthest_step(self) -> int:
        return max(pos.step for pos, _ in self.positions.values())
