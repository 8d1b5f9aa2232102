"""`jaxtrain evaluate MODEL --tasks ...`: lm-eval tasks on a finished run or an exported model,
scored exactly as during training (jaxtrain.evaluation: the same adapter, the same tasks).

MODEL is a run directory (its newest checkpoint, or --checkpoint) or a step directory of one,
a Hugging Face directory or .gguf file, or a PEFT LoRA export merged onto its local base (what
`jaxtrain serve` loads). The scores are printed as a table and, with --output, written as
lm-eval's own results JSON (per-task metrics, standard errors, configurations).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jaxtrain.cli.usage import split_positional
from jaxtrain.errors import EXIT_OK, ArgumentError

__all__ = ["EVALUATE_HELP", "cmd_evaluate"]

EVALUATE_HELP = """usage: jaxtrain evaluate MODEL_OR_RUN_DIR --tasks TASK[,TASK...] [--limit N]
                         [--batch_size 8] [--num_fewshot N] [--checkpoint PATH|STEP] [--output FILE]

Score lm-eval-harness tasks on a model, as a run scores eval_tasks during training: a run
directory (its newest checkpoint) or one of its step directories, a Hugging Face directory or
.gguf file, or a LoRA export (merged onto its local base). Tasks come from local YAML files and
local data; nothing is downloaded. Needs the eval extra (lm-eval).

  --tasks LIST
      Task YAML files, or names of jaxtrain's example tasks (python_mc, python_em).
  --limit INT
      Documents per task (default: all).
  --batch_size INT  (default: 8)
      Requests per compiled step, and sequences generated at once.
  --num_fewshot INT
      Few-shot examples per document (default: each task's own, else 0).
  --checkpoint PATH|STEP
      A run's step directory <run>/checkpoints/<step>, or its step number (default: its newest
      committed one). MODEL may be the step directory itself.
  --output FILE
      Also write lm-eval's results (metrics, standard errors, task configurations) as JSON.
"""

OPTIONS = {"tasks": str, "limit": int, "batch_size": int, "num_fewshot": int,
           "checkpoint": str, "output": str}  # fmt: skip


def parse_evaluate_options(tokens: list[str]) -> tuple[str, dict[str, Any]]:
    from jaxtrain.cli.run_config import parse_overrides
    from jaxtrain.config_values import coerce_value

    path, rest = split_positional(tokens)
    if path is None:
        raise ArgumentError(f"jaxtrain evaluate needs a model or run directory.\n\n{EVALUATE_HELP}")
    raw = parse_overrides(rest)
    unknown = sorted(set(raw) - set(OPTIONS))
    if unknown:
        raise ArgumentError(
            f"jaxtrain evaluate: unknown option(s) {unknown}; options: "
            f"{', '.join('--' + o for o in OPTIONS)}."
        )
    options = {
        key: coerce_value(OPTIONS[key], value, field=f"--{key}", source="command line")
        for key, value in raw.items()
    }
    if not options.get("tasks"):
        raise ArgumentError(
            "jaxtrain evaluate needs --tasks (task YAML files or example names, comma-separated), "
            "e.g. --tasks python_mc,python_em."
        )
    for key in ("limit", "batch_size"):
        if key in options and options[key] < 1:
            raise ArgumentError(f"--{key} must be >= 1, got {options[key]}.")
    if options.get("num_fewshot", 0) < 0:
        raise ArgumentError(f"--num_fewshot must be >= 0, got {options['num_fewshot']}.")
    return path, options


def load_model(path: str, checkpoint: str | None) -> tuple[Any, Any]:
    """(model, tokenizer) of a run directory (at `checkpoint`), an HF directory, .gguf or a
    LoRA export."""
    step = Path(path)
    if (step / "state").is_dir() and (step.parent.parent / "config.yaml").is_file():
        if checkpoint is not None:
            raise ArgumentError(f"{path} is a step directory; drop --checkpoint, or pass the run.")
        path, checkpoint = str(step.parent.parent), path  # <run>/checkpoints/<step>
    if (Path(path) / "config.yaml").is_file():
        from jaxtrain.cli.run_dir import restore_run

        run = restore_run(path, checkpoint)
        if not run.sections.task.generates:
            raise ArgumentError(f"{path} trained a reward model, which lm-eval tasks cannot score.")
        if run.sections.tokenizer is None:
            raise ArgumentError(f"{path} has no tokenizer/ to encode the tasks' text with.")
        return run.model(), run.sections.tokenizer
    if checkpoint is not None:
        raise ArgumentError("--checkpoint picks a step of a run directory; MODEL is not one.")
    from jaxtrain.cli.served_model import load_served_model

    model, tokenizer, _ = load_served_model(path)
    return model, tokenizer


def cmd_evaluate(tokens: list[str]) -> int:
    path, options = parse_evaluate_options(tokens)
    from jaxtrain.evaluation.harness import TaskSuite

    tasks = [t.strip() for t in options["tasks"].split(",") if t.strip()]
    # The tasks first: a missing file or a task that would download fails before the model
    # is loaded.
    suite = TaskSuite(tasks, limit=options.get("limit"), num_fewshot=options.get("num_fewshot"))
    model, tokenizer = load_model(path, options.get("checkpoint"))
    from jaxtrain.evaluation.lm import JaxLM

    lm = JaxLM(model, tokenizer, batch_size=options.get("batch_size", 8))
    logs = suite.evaluate(lm, raw="output" in options)
    print(results_table(logs))
    if "output" in options:
        results = logs.pop("lm_eval")
        out = Path(options["output"])
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2, default=str) + "\n")
        print(f"results: {out}")
    return EXIT_OK


def results_table(logs: dict[str, Any]) -> str:
    """One line per task and metric: value ± standard error."""
    lines = [f"{'task':<24} {'metric':<24} {'value':>8}   stderr"]
    for key, value in logs.items():
        if key.endswith("_stderr") or not key.startswith("eval/"):
            continue
        task, _, metric = key[len("eval/") :].partition("/")
        stderr = logs.get(key + "_stderr")
        shown = f"{stderr:.4f}" if isinstance(stderr, float) else "n/a"
        lines.append(f"{task:<24} {metric:<24} {value:>8.4f} ± {shown}")
    return "\n".join(lines)
