"""Compilation tracking: how long each jitted function took to compile, and why it compiled
again.

`TrackedJit(fn, name, on_event)` behaves like `jax.jit(fn)` but compiles ahead of time once
per argument signature (the shapes, dtypes and shardings of every array argument and the
pytree structure). Each compile reports its duration; a compile for a new signature after
the first one is a recompilation, reported with the argument paths whose shapes changed, so
"why did step 500 take 40 s" has an answer in the log.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax

logger = logging.getLogger("jaxtrain.compile")


@dataclass
class CompileEvent:
    name: str
    seconds: float
    # 1 for the first compile of the function, 2 for the first recompilation, ...
    count: int
    # "path: old -> new" for each argument whose shape or dtype changed (empty at count 1).
    changes: list[str] = field(default_factory=list)

    @property
    def is_recompile(self) -> bool:
        return self.count > 1

    def message(self) -> str:
        if not self.is_recompile:
            return f"compiled {self.name} in {self.seconds:.1f}s"
        what = "; ".join(self.changes) if self.changes else "argument structure changed"
        return (
            f"WARNING: recompiled {self.name} ({self.count} compiles, {self.seconds:.1f}s) "
            f"because argument shapes changed: {what}. Keep batch shapes fixed (pad to a "
            "constant length) to avoid paying this again."
        )


def _describe(leaf: Any) -> tuple[Any, ...]:
    shape = getattr(leaf, "shape", None)
    if shape is None:  # a Python scalar: traced as a weakly typed 0-d array
        return ((), type(leaf).__name__, None)
    sharding = getattr(leaf, "sharding", None)
    return (tuple(shape), str(getattr(leaf, "dtype", "")), sharding)


def signature(args: tuple[Any, ...]) -> tuple[Any, tuple[tuple[Any, ...], ...]]:
    leaves, treedef = jax.tree_util.tree_flatten(args)
    return treedef, tuple(_describe(leaf) for leaf in leaves)


def shape_changes(old: tuple[Any, Any], new: tuple[Any, Any], args: tuple[Any, ...]) -> list[str]:
    """Human-readable differences between two signatures of the same call."""
    if old[0] != new[0]:
        return [f"pytree structure {old[0]} -> {new[0]}"]
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
    changes = []
    for path, (s0, d0, sh0), (s1, d1, sh1) in zip(paths, old[1], new[1]):
        if s0 != s1 or d0 != d1:
            changes.append(f"args{path}: {d0}{list(s0)} -> {d1}{list(s1)}")
        elif sh0 != sh1:
            changes.append(f"args{path}: sharding {sh0} -> {sh1}")
    return changes


class TrackedJit:
    """`jax.jit(fn, **jit_kwargs)` compiled ahead of time per signature, with every compile
    reported to `on_event(CompileEvent)` and the `jaxtrain.compile` logger (at debug level
    when `on_event` shows it to the user already: one line per event). Each compile gets
    `compiler_options` (XLA's DebugOptions names)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        name: str,
        on_event: Callable[[CompileEvent], None] | None = None,
        compiler_options: dict[str, Any] | None = None,
        on_event_shows: bool = False,
        **jit_kwargs: Any,
    ):
        self.name = name
        self._on_event_shows = on_event_shows
        self._compiler_options = compiler_options or None  # XLA options of each compile
        self._jitted = jax.jit(fn, **jit_kwargs)
        self._on_event = on_event
        self._compiled: dict[Any, Any] = {}
        self._last_signature: Any = None
        self._last: Any = None
        self.events: list[CompileEvent] = []

    def lower(self, *args: Any):
        return self._jitted.lower(*args)

    @property
    def executable(self) -> Any:
        """The executable of the last call or compile (for HLO inspection), or None."""
        return self._last

    def compile(self, *args: Any) -> Any:
        """Compile for these arguments now (ahead of the first call); returns the executable."""
        return self.lower_for(*args)()

    def lower_for(self, *args: Any) -> Callable[[], Any]:
        """Trace and lower for these arguments now, in this thread (JAX's thread-local
        settings, such as `jax.default_matmul_precision`, apply to the trace); returns the
        rest of the compile, XLA's part, to call in any thread (XLA releases the GIL): it
        returns the executable, which later calls use."""
        sig = signature(args)
        compiled = self._compiled.get(sig)
        if compiled is not None:
            return lambda: self._use(sig, compiled)
        start = time.perf_counter()
        lowered = self._jitted.lower(*args)
        lower_seconds = time.perf_counter() - start

        def finish() -> Any:
            start = time.perf_counter()
            compiled = lowered.compile(compiler_options=self._compiler_options)
            self._record(sig, args, compiled, lower_seconds + time.perf_counter() - start)
            return self._use(sig, compiled)

        return finish

    def _use(self, sig: Any, compiled: Any) -> Any:
        self._last_signature, self._last = sig, compiled
        return compiled

    def __call__(self, *args: Any) -> Any:
        # Fast path: the executable of the last call checks the argument types itself (before
        # running or donating anything) and raises TypeError/ValueError when they differ;
        # only then is the signature computed (about 20 us per array argument).
        if self._last is not None:
            try:
                return self._last(*args)
            except (TypeError, ValueError):
                if signature(args) == self._last_signature:
                    raise  # not a signature change: a real error
        return self.compile(*args)(*args)

    def _record(self, sig: Any, args: tuple[Any, ...], compiled: Any, seconds: float) -> None:
        changes = []
        if self._last_signature is not None:
            changes = shape_changes(self._last_signature, sig, args)
        self._compiled[sig] = compiled
        event = CompileEvent(self.name, seconds, len(self.events) + 1, changes)
        self.events.append(event)
        level = logging.WARNING if event.is_recompile else logging.INFO
        logger.log(logging.DEBUG if self._on_event_shows else level, event.message())
        if self._on_event is not None:
            self._on_event(event)

    @property
    def compiles(self) -> int:
        return len(self.events)


def memory_summary(executable: Any, platform: str | None = None) -> dict[str, float] | None:
    """Per-device bytes XLA assigned to a compiled program: its inputs, outputs (those
    written over donated inputs counted once), temporaries, and the peak they add up to.
    None when the backend does not say.

    XLA:TPU (`platform="tpu"`) reports its buffer assignment's peak itself
    (`peak_memory_in_bytes`), and its `temp_size_in_bytes` leaves out what a while loop
    holds (0 for a step with 2 micro-batches whose peak is 14.3 MB): there the peak is the
    compiler's and the temporaries are what it adds to the inputs and outputs. XLA:CPU's
    `peak_memory_in_bytes` is smaller than its own temporaries, so elsewhere the peak is
    the sum."""
    try:
        memory = executable.memory_analysis()
    except (AttributeError, NotImplementedError, RuntimeError):  # some backends have none
        return None
    if memory is None:
        return None
    summary = {
        "arguments": float(memory.argument_size_in_bytes),
        "outputs": float(memory.output_size_in_bytes),
        "aliased": float(memory.alias_size_in_bytes),
        "temporaries": float(memory.temp_size_in_bytes),
        "generated_code": float(memory.generated_code_size_in_bytes),
    }
    held = summary["arguments"] + summary["outputs"] - summary["aliased"]
    summary["peak"] = held + summary["temporaries"]
    reported = float(getattr(memory, "peak_memory_in_bytes", 0) or 0)
    if platform == "tpu" and reported > 0:
        summary["temporaries"] = max(0.0, reported - held)
        summary["peak"] = reported
    return summary
