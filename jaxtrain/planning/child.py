"""Run a planning module in a child process with N CPU devices: `jaxtrain plan`'s compiles
(worker.py) and, on a CPU, the search for settings that fit a step that ran out of memory
(fit.py). The child has the device count the compile needs (XLA_FLAGS is read once, when
its backend starts) and an address space of its own."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def run_child(module: str, spec: dict[str, Any], devices: int, *, label: str) -> Any:
    """`python -m module SPEC OUT` with `devices` CPU devices; what it wrote to OUT.
    `label` names the command in the line of a Ctrl-C and in the error of a failed child."""
    with tempfile.TemporaryDirectory(prefix="jaxtrain-plan-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ)
        flags = env.get("XLA_FLAGS", "").split()
        flags = [f for f in flags if "xla_force_host_platform_device_count" not in f]
        flags.append(f"--xla_force_host_platform_device_count={devices}")
        env.update(XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
        # A session of its own: the terminal's Ctrl-C reaches only this process, which ends
        # the child itself (_ends_with), so the child never prints a traceback of its own.
        with _ends_with(label, Path(tmp)) as started:
            child = subprocess.Popen(
                [sys.executable, "-m", module, str(spec_path), str(out_path)],
                env=env,
                start_new_session=True,
            )
            try:
                started(child)
                code = child.wait()
            finally:
                if child.poll() is None:  # this process is failing: the compile must not outlive it
                    child.kill()
                    child.wait()
        if code != 0:
            raise RuntimeError(f"{label}'s compile process failed (exit {code}).")
        return json.loads(out_path.read_text())


@contextlib.contextmanager
def _ends_with(label: str, scratch: Path) -> Iterator[Callable[[subprocess.Popen], None]]:
    """Ctrl-C while the child compiles: the child is killed, its `scratch` directory removed
    (the exit below skips the `with` that would), then one line and exit 130. Only where the
    command line installed its interrupt handling (the process's own entry).

    The handler is in place before the child starts (a Ctrl-C that arrived between the
    start and the handler once met the command line's generic line); a Ctrl-C before the
    child is known is acted on as soon as `started` names it."""
    from jaxtrain import interrupts

    children: list[subprocess.Popen] = []
    interrupted: list[bool] = []

    def end() -> None:
        # os.kill, not child.kill() + wait(): the interrupted wait holds Popen's lock.
        with contextlib.suppress(ProcessLookupError):
            os.kill(children[0].pid, signal.SIGKILL)
        shutil.rmtree(scratch, ignore_errors=True)  # the spec: what is left is no output
        interrupts.abort(label, "interrupted by SIGINT; nothing was written")

    def started(child: subprocess.Popen) -> None:
        children.append(child)
        if interrupted:
            end()

    if not interrupts.installed() or threading.current_thread() is not threading.main_thread():
        yield children.append
        return

    def handle(number: int, frame: Any) -> None:
        if children:
            end()
        interrupted.append(True)  # Popen has not returned the child yet: `started` ends it

    previous = signal.signal(signal.SIGINT, handle)
    try:
        yield started
    finally:
        signal.signal(signal.SIGINT, previous)
