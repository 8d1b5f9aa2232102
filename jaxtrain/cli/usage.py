"""The usage text of `jaxtrain` (a leaf: every command module may quote it)."""

from jaxtrain.errors import ArgumentError
from jaxtrain.tasks import TASKS

EXPORT_USAGE = (
    "jaxtrain export RUN_OR_CHECKPOINT OUT_DIR [--max_shard_size 5GB] [--dtype bfloat16] "
    "[--lora_format merged|peft]"
)

USAGE = f"""usage:
  jaxtrain train [CONFIG.yaml|json] [--field value ...] [--model.field value] [--data.field value]
                 [--dry_run]   (print mesh, per-device memory and parameter shardings; no training)
                 [--task {"|".join(TASKS)}]  (the trainer; distill: --teacher.pretrained DIR)
  jaxtrain eval RUN_DIR [--checkpoint PATH|STEP] [--max_eval_batches N]
  jaxtrain evaluate MODEL_OR_RUN_DIR --tasks TASK[,TASK...] [--limit N]   (lm-eval tasks)
  jaxtrain sample RUN_DIR [--prompt TEXT] [--max_new_tokens N] [--temperature T] [--top_p P]
  {EXPORT_USAGE}
  jaxtrain report RUN_DIR   (writes RUN_DIR/report.png and report.html)
  jaxtrain serve MODEL_OR_RUN_DIR [--port 8000] [--max_slots 8] [--api_key KEY] [--warm_up true]
                 (an OpenAI-compatible server; compiles every shape before it listens)
  jaxtrain plan [CONFIG.yaml] [--hf_config config.json] --devices N --accelerator h100 [--sweep|--choices]
                [--accelerator v5e|v5p|v6e --topology 2x4]   (TPU slices, compiled by XLA:TPU)
  jaxtrain launch --ray|--slurm [options] COMMAND ...   (one jaxtrain per Ray actor / SLURM task)
  jaxtrain tune CONFIG.yaml --search 'lr=loguniform(1e-4,1e-2)' [--num_samples N] [--scheduler asha]
  jaxtrain --version

`jaxtrain COMMAND --help` (or -h) lists every option of COMMAND with its type, default and doc.

Every TrainingArguments field can be set in the config file or as --field value.
With no config, `jaxtrain train` trains a small Llama on the embedded corpus (the demo).
`--model.pretrained DIR` fine-tunes a local Hugging Face model; `export` writes one.
"""


def split_positional(tokens: list[str]) -> tuple[str | None, list[str]]:
    """(the positional argument or None, the `--key value` rest). The positional may stand
    anywhere on the line (`train --task reward dpo.yaml`): a token is a value when it
    follows a `--key` without `=` (unless it is a `--key` itself: the first one has no value,
    which parse_overrides says), else it is the positional; a second one is an error."""
    positional: list[str] = []
    rest: list[str] = []
    index = 0
    while index < len(tokens):
        token = tokens[index]
        if (
            token.startswith("--")
            and "=" not in token
            and index + 1 < len(tokens)
            and not tokens[index + 1].startswith("--")
        ):
            rest += tokens[index : index + 2]
            index += 2
            continue
        (rest if token.startswith("--") else positional).append(token)
        index += 1
    if len(positional) > 1:
        raise ArgumentError(
            f"one positional argument expected (a config file or RUN_DIR), got {positional}; "
            "every other value follows its --key."
        )
    return (positional[0] if positional else None), rest
