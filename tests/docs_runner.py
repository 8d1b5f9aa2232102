"""The interpreter of tests/test_docs.py: runs the pages' blocks in order, in one namespace.

    python docs_runner.py blocks.json [docs_result NAME...]

blocks.json holds rows (page, line, kind, code, target, xla_flags). A ```python block is
pasted after the ones before it; a ```bash block runs with `bash -e`, except a block that is
only `jaxtrain` commands on this interpreter's devices: each runs here through the console
script's own function, `jaxtrain.cli.main(args)`, as Ray workers and Tune trials call it,
with the arguments bash would pass and the console script's sys.path. A process of its own
for each command cost its imports and its eager programs again: 2-3 CPU-s a command, and the
pages have 35 (bench/RESULTS.md, session 63). The console script itself runs in
real processes in tests/test_cli.py.

Each block's wall and CPU seconds (the CPU of the commands a shell ran included) go to
block_seconds.jsonl in the working directory (pytest's --basetemp keeps it): where the
suite's longest test spends its time. With `docs_result NAME...`, the namespace's values of
those names go to docs_result.json.
"""

import gc
import json
import os
import shlex
import subprocess
import sys
import time

from jaxtrain.cli import main as jaxtrain
from jaxtrain.cli.collector import collect_less_often

# Anything bash would expand or interpret, outside quotes: such a block runs in bash.
SHELL_SYNTAX = set("$`*?[]{}~|&;<>()!")


def jaxtrain_commands(code: str) -> list[list[str]] | None:
    """The argument lists of a block that is only `jaxtrain` commands, split as bash splits
    them (quotes, comments, continued lines); None for a block that uses more of the shell."""
    found = []
    for line in code.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=False)  # keeps the quotes: what bash would expand
        lexer.whitespace_split = True
        words = list(lexer)
        if not words:
            continue
        unquoted = [word for word in words if word[0] not in "'\""]
        if words[0] != "jaxtrain" or any(SHELL_SYNTAX & set(word) for word in unquoted):
            return None
        found.append(shlex.split(line, comments=True)[1:])
    return found


def run_commands(where: str, commands: list[list[str]]) -> None:
    script_folder = sys.path.pop(0)  # the console script's path lacks this directory
    try:
        for args in commands:
            print(f"$ jaxtrain {shlex.join(args)}", flush=True)
            try:
                exit_code = jaxtrain(args)
            except SystemExit as exited:  # a process's exit, here the command's end alone
                exit_code = exited.code if isinstance(exited.code, int) else int(bool(exited.code))
            gc.collect()  # the command's model and data, before the next one builds its own
            if exit_code != 0:
                sys.exit(f"{where}: `jaxtrain {shlex.join(args)}` exited {exit_code}")
    finally:
        sys.path.insert(0, script_folder)


def run(rows: list, namespace: dict, timings) -> None:
    for page, line, kind, code, target, xla_flags in rows:
        print(f"--- {page}:{line} ({kind})", flush=True)
        started, cpu_before = time.perf_counter(), os.times()
        here = xla_flags == os.environ.get("XLA_FLAGS")  # the block's devices are these
        commands = jaxtrain_commands(code) if kind == "bash" and here else None
        if kind == "python":
            exec(compile(code, f"{page}:{line}", "exec"), namespace)
        elif commands:
            run_commands(f"{page}:{line}", commands)
        elif kind == "bash":
            env = {**os.environ, "XLA_FLAGS": xla_flags}  # a shell block's own device count
            done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", code], env=env)
            if done.returncode != 0:
                sys.exit(f"{page}:{line}: the shell block exited {done.returncode}")
        elif kind == "file":
            os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
            with open(target, "w") as written:
                written.write(code)
        if kind == "python":  # what the blocks keep stays out of the collector's walk
            gc.collect()
            gc.freeze()
        seconds = round(time.perf_counter() - started, 1)
        cpu = sum(os.times()[:4]) - sum(cpu_before[:4])  # this process's and its children's
        timings.write(json.dumps([page, line, kind, seconds, round(cpu, 1)]) + "\n")
        timings.flush()


if __name__ == "__main__":
    collect_less_often()  # tracing allocates millions of objects: the commands' thresholds
    namespace = {"__name__": "__main__"}
    with open(sys.argv[1]) as rows, open("block_seconds.jsonl", "a") as timings:
        run(json.load(rows), namespace, timings)
    if "docs_result" in sys.argv[2:]:
        with open("docs_result.json", "w") as result:
            json.dump({k: namespace[k] for k in sys.argv[3:]}, result)
