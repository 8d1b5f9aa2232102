"""An environment whose tool runs the model's Python code in a subprocess with limits.

    GRPOTrainer(..., environment_factory=PythonInterpreter)
    GRPOTrainer(..., environment_factory=functools.partial(PythonInterpreter, seconds=2))

Each call starts a fresh `python -I` (isolated mode: no user site-packages, no PYTHON*
variables, no current directory on sys.path) in an empty temporary directory, with an
address-space limit (`memory_mb`), a CPU-time limit and a wall-clock limit (`seconds`) and no
core files. It answers with what the code
printed (stdout, then stderr), cut to `max_output` characters; a code that is stopped answers
why.

What it does not isolate: the file system (the code can read and write whatever the user
running the trainer can; the temporary directory is only where it starts), the network,
other processes of the same user, and processes the code starts (a fork bomb is not stopped:
the limits hold per process). On Linux and macOS only (resource limits); run untrusted
code in a container or a sandbox of its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from typing import Any

__all__ = ["PythonInterpreter"]


class PythonInterpreter:
    """See the module docstring. Its one tool is `run_python(code)`; `reset` keeps nothing
    between rollouts (each call is a fresh process), and counts the calls and errors."""

    def __init__(
        self,
        seconds: float = 5.0,
        memory_mb: int = 256,
        max_output: int = 2000,
    ):
        self.seconds, self.memory_mb, self.max_output = seconds, memory_mb, max_output
        self.calls = self.errors = 0

    def reset(self, **row: Any) -> None:
        self.calls = self.errors = 0

    def run_python(self, code: str) -> str:
        """Run Python code and return what it printed.

        Args:
            code: The Python program to run; print the values you need.
        """
        self.calls += 1
        with tempfile.TemporaryDirectory(prefix="jaxtrain-python-") as where:
            try:
                done = subprocess.run(
                    [sys.executable, "-I", "-c", code],
                    cwd=where,
                    capture_output=True,
                    text=True,
                    timeout=self.seconds,
                    preexec_fn=self._limit,
                    env={"PATH": os.environ.get("PATH", ""), "PYTHONHASHSEED": "0"},
                )
            except subprocess.TimeoutExpired:
                self.errors += 1
                return f"stopped: the code ran past {self.seconds:g} s"
        out = (done.stdout + done.stderr)[: self.max_output]
        if done.returncode != 0:
            self.errors += 1
            if done.returncode < 0:  # killed by a signal: the CPU limit, or memory
                return out + f"\nstopped: killed by signal {-done.returncode} (time or memory)"
        return out

    def _limit(self) -> None:
        """Runs in the child before Python starts: its limits."""
        import resource

        memory = self.memory_mb * 2**20
        cpu = max(1, int(self.seconds) + 1)
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
