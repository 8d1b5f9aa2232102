"""`jaxtrain train | eval | sample | export | report`: the command line.

`jaxtrain train` with no arguments trains the demo model on the embedded corpus.

  __init__.py    main(): dispatch, and the one place errors become exit codes
  usage.py       the usage text
  help.py        `jaxtrain COMMAND --help`: every option with its type, default and doc
  huge_pages.py  train and eval restart once with glibc's huge-page tunable (faster CPU steps)
  collector.py   the command's process collects garbage less often (tracing allocates much)
  run_config.py  config file + --flags -> one mapping (TrainingArguments + model/data/sample)
  run_dir.py     build_model, build_data, load_run, restore_run: a run directory's pieces
  pretrained.py  the `model.pretrained` section (fine-tuning a local Hugging Face model)
  commands.py    train, eval, sample, report
  evaluate.py    evaluate (lm-eval tasks on a run or an exported model)
  export.py      export (a run or checkpoint -> a Hugging Face directory)
  launch.py      launch (--ray / --slurm) and tune: runs past one machine
  tune.py        Ray Tune over `jaxtrain train` trials (search spaces, best.yaml)

Heavy imports (jax, transformers) happen inside the commands, so `jaxtrain --help` is fast.
"""

from __future__ import annotations

import os
import sys

from jaxtrain.cli.usage import USAGE

__all__ = ["COMMANDS", "USAGE", "main"]

COMMANDS = ("train", "eval", "evaluate", "sample", "export", "report", "plan", "serve")


def main(argv: list[str] | None = None) -> int:
    """The `jaxtrain` command. With `argv` None it is the process's entry point and may end
    the process itself (Ctrl-C handling, exit after a refused restore); called with a list
    (tests, Ray workers, Tune trials) it only returns the exit code."""
    entry = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    if argv[0] in ("--version", "-V", "version"):
        from jaxtrain import __version__

        print(f"jaxtrain {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command in COMMANDS and any(t in ("-h", "--help") for t in rest):
        from jaxtrain.cli.help import command_help
        from jaxtrain.errors import ArgumentError

        try:
            print(command_help(command, rest))
        except ArgumentError as err:  # e.g. --task with no such task
            print(f"jaxtrain {command}: error: {err}", file=sys.stderr)
            return err.exit_code
        return 0
    from jaxtrain import interrupts

    if entry:  # this process is the command's own
        from jaxtrain.cli.collector import collect_less_often

        collect_less_often()
    if entry and command in COMMANDS:  # launch/tune: Ray's
        from jaxtrain.cli.huge_pages import restart_with_huge_pages

        restart_with_huge_pages(command)  # train, eval: before jax (glibc reads it at start)
        interrupts.install(f"jaxtrain {command}")  # Ctrl-C from here on: exit 130, no traceback
    return _dispatch(command, rest, entry=entry)


def _dispatch(command: str, rest: list[str], *, entry: bool) -> int:
    from jaxtrain.cli.commands import cmd_eval, cmd_report, cmd_sample, cmd_train
    from jaxtrain.cli.evaluate import cmd_evaluate
    from jaxtrain.cli.export import cmd_export
    from jaxtrain.cli.launch import cmd_launch, cmd_tune
    from jaxtrain.cli.plan import cmd_plan
    from jaxtrain.cli.serve import cmd_serve
    from jaxtrain.errors import CheckpointError, JaxtrainError, TrainingInterrupted

    commands = {
        # The process's own command may freeze its heap (collector.freeze_the_heap); a caller's
        # (a test, a Tune trial) must not: its later garbage would never be collected.
        "train": lambda tokens: cmd_train(tokens, own_process=entry),
        "eval": cmd_eval,
        "evaluate": cmd_evaluate,
        "sample": cmd_sample,
        "export": cmd_export,
        "report": cmd_report,
        "plan": cmd_plan,
        "serve": lambda tokens: cmd_serve(tokens, own_process=entry),
        "launch": lambda tokens: cmd_launch(tokens, entry=main),  # workers run this CLI
        "tune": cmd_tune,
    }
    if command not in commands:
        import difflib

        close = difflib.get_close_matches(command, list(commands), n=1)
        hint = f" Did you mean `jaxtrain {close[0]}`?" if close else ""
        print(f"jaxtrain: unknown command {command!r}.{hint}\n\n{USAGE}", file=sys.stderr)
        return 2
    try:
        return commands[command](rest)
    except JaxtrainError as err:
        # The one place a deliberate error becomes its message and exit code; anything
        # else is a bug and keeps its traceback (exit 1).
        interrupted = isinstance(err, TrainingInterrupted)  # every process stopped together
        # In a multi-host run: a lost peer is the cause to report, else the peers learn that
        # this process ends. Only a run that joined a cluster has imported the watch; an
        # argument error must not import jax (and the parallel package) to find that out.
        peers = sys.modules.get("jaxtrain.parallel.peers")
        if not interrupted and peers is not None:
            peers.report_error(err.exit_code)
        label = "" if interrupted else "error: "
        print(f"jaxtrain {command}: {label}{err}", file=sys.stderr)
        if entry and isinstance(err, CheckpointError):
            # Orbax's coroutines left unfinished when it gave up would be reported by the
            # interpreter's shutdown ("coroutine ... was never awaited") after this line.
            # Nothing here needs the exit hooks: the loop already closed the logs and
            # trackers, and a refused restore opened none.
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(os.open(os.devnull, os.O_WRONLY), 2)  # their threads print nothing more
            os._exit(err.exit_code)
        return err.exit_code
