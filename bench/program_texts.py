"""Which programs a pytest run hands to XLA, and which of them differ only in their constants:
pytest with a plugin that logs every module JAX compiles or reads from its cache (its name, a
hash of its text, a hash of its text with every constant masked, the seconds it took), then a
summary by function name and, for each group of programs whose texts differ only in
constants, the first line where two of them differ and its source location.

    python bench/program_texts.py --out /tmp/programs -- -n 2 --dist loadfile tests/trainers

Everything after `--` goes to pytest. Programs that share a masked text compile apart only
because a number is baked into them (an optimizer's learning rate was, until session 68): each
such group is a program a value passed as an input would save. The plugin wraps
`jax._src.compiler.compile_or_get_cached`, a private function (jax 0.10).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

from suite_profile import run_pytest_with_plugin, split_at_dashes

OUT_VARIABLE = "JAXTRAIN_PROGRAM_TEXTS"  # the workers find the output folder here
SAVE_VARIABLE = "JAXTRAIN_PROGRAM_TEXTS_SAVE"  # which modules' texts are kept, by name
CONSTANT = re.compile(r"dense<[^>]*>")
LOCATION = re.compile(r" loc\((#loc\d+)\)")


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:16]


class ProgramLog:
    """A pytest plugin: one JSON line per module handed to XLA, in `<out>/log-<pid>.jsonl`."""

    def __init__(self, out: Path, save: re.Pattern) -> None:
        self.out, self.save, self.test = out, save, None
        (out / "text").mkdir(parents=True, exist_ok=True)

    def wrap_compiler(self) -> None:
        """At the first test: the tests' conftest sets XLA's flags before jax is imported."""
        from jax._src import compiler

        original = compiler.compile_or_get_cached

        def logged(backend, computation, *args, **kwargs):
            started = time.perf_counter()
            executable = original(backend, computation, *args, **kwargs)
            self.log(computation, time.perf_counter() - started)
            return executable

        compiler.compile_or_get_cached = logged

    def log(self, computation, seconds: float) -> None:
        from jax._src.lib.mlir import ir

        name = ir.StringAttr(computation.operation.attributes["sym_name"]).value
        text = computation.operation.get_asm(enable_debug_info=False)
        full = _digest(text)
        if self.save.search(name):
            kept = self.out / "text" / f"{full}.mlir"
            if not kept.exists():  # with locations: the summary names where a constant is
                kept.write_text(computation.operation.get_asm(enable_debug_info=True))
        row = dict(test=self.test, name=name, full=full, masked=_digest(CONSTANT.sub("C", text)))
        with open(self.out / f"log-{os.getpid()}.jsonl", "a") as log:
            log.write(json.dumps(row | {"s": round(seconds, 4)}) + "\n")

    def pytest_runtest_setup(self, item) -> None:
        if self.test is None:
            self.wrap_compiler()
        self.test = item.nodeid


def pytest_configure(config) -> None:
    """Registers the plugin in pytest and in every xdist worker (`-p program_texts`)."""
    if OUT_VARIABLE in os.environ and not config.pluginmanager.has_plugin("program_log"):
        log = ProgramLog(Path(os.environ[OUT_VARIABLE]), re.compile(os.environ[SAVE_VARIABLE]))
        config.pluginmanager.register(log, "program_log")


def function_name(module_name: str) -> str:
    """`jit_train_step.12` -> `jit_train_step`."""
    return re.sub(r"[._]\d+$", "", module_name)


def first_difference(a: str, b: str) -> str:
    """Where two saved texts first differ: the differing constant (masked), the first line
    that uses it, and that line's source frames outside site-packages (innermost first)."""
    lines_a, lines_b = a.splitlines(), b.splitlines()
    aliases = dict(re.findall(r"^(#loc\d+) = (loc\(.*\))$", a, re.M))
    for i, (line_a, line_b) in enumerate(zip(lines_a, lines_b, strict=False)):
        if line_a.startswith("#loc") or LOCATION.sub("", line_a) == LOCATION.sub("", line_b):
            continue
        value = re.match(r"\s*(%[\w#]+)", line_a)
        use = next(
            (line for line in lines_a[i + 1 :] if value and re.search(rf"{value[1]}\b", line)),
            line_a,
        )
        frames = re.findall(r'"([^"]+\.py)":(\d+)', _resolve(use, aliases))
        ours = [f"{Path(f).name}:{n}" for f, n in frames if "site-packages" not in f]
        shown = CONSTANT.sub("C", LOCATION.sub("", use).strip())[:100]
        return f"{CONSTANT.sub('C', LOCATION.sub('', line_a).strip())[:70]}\n" + (
            f"        used by {shown}\n        at {' < '.join(dict.fromkeys(ours))}"
        )
    return "(the same but for locations)"


def _resolve(line: str, aliases: dict[str, str]) -> str:
    """A line's location with its nested aliases written out (at most 12 levels)."""
    for _ in range(12):
        inner = re.search(r"#loc\d+", line)
        if inner is None:
            break
        line = line.replace(inner[0], aliases.get(inner[0], "?"), 1)
    return line


def summary(rows: list[dict], texts: Path, top: int) -> list[str]:
    """Per function: calls, distinct texts, distinct texts without constants, seconds; then
    the groups split by constants among the saved texts."""
    by_name: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        by_name[function_name(row["name"])].append(row)
    out = [f"{len(rows)} modules, {sum(r['s'] for r in rows):.1f} s", "calls texts masked s  name"]
    ranked = sorted(by_name.items(), key=lambda item: -sum(r["s"] for r in item[1]))
    for name, named in ranked[:top]:
        full, masked = len({r["full"] for r in named}), len({r["masked"] for r in named})
        out.append(
            f"{len(named):5d} {full:5d} {masked:6d} {sum(r['s'] for r in named):5.1f}  {name}"
        )
    groups: dict[str, set[str]] = defaultdict(set)
    for row in rows:
        if (texts / f"{row['full']}.mlir").exists():
            groups[row["masked"]].add(row["full"])
    split = [sorted(fulls) for fulls in groups.values() if len(fulls) > 1]
    extra = sum(len(fulls) - 1 for fulls in split)
    out.append(f"saved texts: {len(groups)} without constants; {extra} more only by constants:")
    where: dict[str, int] = defaultdict(int)
    for fulls in split:
        first = (texts / f"{fulls[0]}.mlir").read_text()
        for other in fulls[1:]:
            where[first_difference(first, (texts / f"{other}.mlir").read_text())] += 1
    out += [f"{n:5d}  {line}" for line, n in sorted(where.items(), key=lambda kv: -kv[1])]
    return out


def main(argv: list[str] | None = None) -> int:
    ours, theirs = split_at_dashes(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="program_texts")
    parser.add_argument("--save", default="step", help="regex: whose texts are kept and compared")
    parser.add_argument("--top", type=int, default=25, help="function names in the summary")
    opts = parser.parse_args(ours)
    out = Path(opts.out).resolve()
    for old in out.glob("log-*.jsonl"):
        old.unlink()
    os.environ[OUT_VARIABLE], os.environ[SAVE_VARIABLE] = str(out), opts.save
    code = run_pytest_with_plugin("program_texts", theirs)
    rows = [json.loads(line) for log in out.glob("log-*.jsonl") for line in log.open()]
    print("\n".join(summary(rows, out / "text", opts.top)))
    return code


if __name__ == "__main__":
    sys.exit(main())
