"""`--help` of every `jaxtrain` command, generated from the dataclasses the CLI parses.

Every field is listed with its type, default and the one-line doc written as a comment
above it in the source (TrainingArguments, LlamaConfig) or beside it (the data and sample
schemas), so the help cannot drift from the code.

Why jaxtrain keeps its own parser rather than tyro, jsonargparse or draccus (all three are
well kept and on PyPI; draccus, Levanter's, comes closest with dotted `--model.x` keys and
YAML): the command line's contract is already set and tested, and each library would change
it. `--flag value` for booleans (`--overwrite_output_dir true`), comma lists (`--report_to
jsonl,wandb`, `--sharding_axis_dims 1,-1,1,1,1`), YAML mappings as values (`--sharding_rules
'{mlp: tp}'`), a model section that is either LlamaConfig fields or `pretrained: DIR`, the
demo-or-defaults merge rule with printed origins, errors from the JaxtrainError family with
"did you mean" and exit code 2, and the run directory's config.yaml read back by eval/sample
all need either adapters around the library's own parsing, type coercion and error exits,
or breaking changes for users. What the libraries would add beyond that is help text; it
is generated here from the same dataclasses in ~150 lines, with no new dependency on the
start-up path of every run.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from typing import Any

# One-line docs of fields whose source has no comment of their own (grouped fields).
MORE_DOCS = {
    "seed": "Seed of parameter init, data order and per-step randomness.",
    "learning_rate": "Peak learning rate (reached at the end of warmup).",
    "optimizer": "The optimizer.",
    "scheduler": "Learning-rate schedule after warmup.",
    "warmup_steps": "Steps of linear warmup to learning_rate; must be < the run's steps.",
    "adam_beta1": "Adam/Lion first-moment decay.",
    "adam_beta2": "Adam/Lion second-moment decay.",
    "adam_epsilon": "Adam denominator epsilon.",
    "max_steps": "Optimizer updates of the run; -1 = num_train_epochs over the data.",
    "max_sequence_length": "Tokens per row; longer rows are truncated (truncation_mode).",
    "shuffle_train": "Shuffle the training rows each epoch (seeded).",
    "param_dtype": "dtype of the master parameters and optimizer state; None = as built.",
    "evaluation_strategy": "When to evaluate on dataset_eval.",
    "eval_steps": "Evaluate every this many steps (evaluation_strategy='steps').",
    "max_nan_skips": "on_nan='skip': stop after this many consecutive skipped updates.",
    "progress_bar": "Progress display; rich/tqdm print plain lines outside a terminal.",
    "run_name": "Name of the run in trackers (default: run-<date>-<time>).",
    "coordinator_address": "Multi-host: host:port of process 0.",
    "num_processes": "Multi-host: number of processes of the cluster.",
    "process_id": "Multi-host: this process's index.",
    "vocab_size": "Vocabulary size (default: the tokenizer's).",
    "hidden_size": "Width of the residual stream.",
    "intermediate_size": "Width of the MLP.",
    "num_hidden_layers": "Decoder layers.",
    "num_attention_heads": "Query heads; must divide hidden_size unless head_dim is set.",
    "num_key_value_heads": "Key/value heads (grouped-query attention); None = num_attention_heads.",
    "head_dim": "Per-head width; None = hidden_size // num_attention_heads.",
    "hidden_act": "MLP activation.",
    "max_position_embeddings": "Longest sequence the rotary embedding is set up for.",
    "initializer_range": "Std of the normal parameter init.",
    "rms_norm_eps": "RMSNorm epsilon.",
    "rope_theta": "Rotary embedding base.",
    "rope_scaling": "Rotary scaling as in HF configs, e.g. {rope_type: llama3, factor: 8}.",
    "mlp_bias": "Biases in the MLP projections.",
    "tie_word_embeddings": "Share the embedding matrix with the output projection.",
    "sliding_window": "Attend only to this many previous tokens; None = full causal.",
    "bos_token_id": "Begin-of-sequence id (default: the tokenizer's).",
    "eos_token_id": "End-of-sequence id(s) (default: the tokenizer's).",
    "pad_token_id": "Padding id (default: the tokenizer's, else its eos).",
    "model_type": "Architecture family of the config.",
}

_FIELD = re.compile(r"^\s+(\w+)\s*:\s*[^=]+?(=.*)?$")
_SCHEMA_ENTRY = re.compile(r'^\s+"(\w+)":\s*[\w.]+,\s*#\s*(.*)$')


def field_docs(cls: type) -> dict[str, str]:
    """{field: the comment lines right above it} from the class source ("" if none)."""
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):
        return {}
    names = {f.name for f in dataclasses.fields(cls)}
    docs: dict[str, str] = {}
    pending: list[str] = []
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("#"):
            text = stripped.lstrip("#").strip()
            # Section banners ("--- data ---", "Optimisation.") are not a field's doc.
            if not text.startswith("---") and not re.fullmatch(r"\w+\.", text):
                pending.append(text)
            continue
        match = _FIELD.match(line)
        if match and match.group(1) in names and match.group(1) not in docs:
            docs[match.group(1)] = " ".join(pending)
        pending = []
    return docs


def schema_docs(module: Any, name: str) -> dict[str, str]:
    """{key: inline comment} of a `NAME = {"key": type,  # doc}` mapping in `module`."""
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):
        return {}
    block = source.split(f"{name} = {{", 1)[-1].split("\n}", 1)[0]
    return {m.group(1): m.group(2) for m in map(_SCHEMA_ENTRY.match, block.splitlines()) if m}


def type_name(annotation: Any) -> str:
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "").replace("NoneType", "None")


def _entry(flag: str, kind: str, default: Any, doc: str) -> str:
    default_text = "" if default is dataclasses.MISSING else f"  (default: {default!r})"
    head = f"  --{flag} {kind.upper() if kind.isidentifier() else kind}{default_text}"
    return head + (f"\n      {doc}" if doc else "")


def dataclass_help(
    cls: type,
    prefix: str = "",
    choices: dict[str, tuple] | None = None,
    only: set[str] | None = None,
) -> str:
    """Every field of `cls` (or those in `only`) with its type, default and doc."""
    hints = typing.get_type_hints(cls)
    docs = inherited_docs(cls)
    entries = []
    for f in dataclasses.fields(cls):
        if only is not None and f.name not in only:
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        doc = docs.get(f.name) or MORE_DOCS.get(f.name, "")
        if choices and f.name in choices:
            doc = (doc + " " if doc else "") + f"One of: {', '.join(choices[f.name])}."
        entries.append(_entry(prefix + f.name, type_name(hints[f.name]), default, doc))
    return "\n".join(entries)


def inherited_docs(cls: type) -> dict[str, str]:
    """field_docs of `cls` and of every dataclass it inherits from (a task's arguments class
    documents only its own fields; the rest are TrainingArguments')."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            docs.update({k: v for k, v in field_docs(klass).items() if v})
    return docs


def task_fields_help(task: str | None) -> str:
    """The fields a task adds to TrainingArguments: of `task`, or of every task."""
    from jaxtrain.arguments import task_fields
    from jaxtrain.tasks import TASKS

    blocks = []
    for name, definition in TASKS.items():
        cls = definition.arguments
        extra = set(task_fields(cls))
        if extra and task in (None, name):
            blocks.append(
                f"--task {name} ({cls.__name__}: top level of CONFIG or --field value):\n"
                + dataclass_help(cls, choices=definition.choices, only=extra)
            )
    return "\n\n".join(blocks)


def task_names() -> str:
    """ "lm, cpo, ... or sft": every task `--task` takes."""
    from jaxtrain.tasks import TASKS

    names = list(TASKS)
    return f"{', '.join(names[:-1])} or {names[-1]}"


def schema_help(schema: dict[str, type], docs: dict[str, str], prefix: str, defaults: dict) -> str:
    return "\n".join(
        _entry(
            prefix + key, kind.__name__, defaults.get(key, dataclasses.MISSING), docs.get(key, "")
        )
        for key, kind in schema.items()
    )


def train_help(task: str | None = None) -> str:
    """`jaxtrain train [--task TASK] --help`: with a task, its arguments class's fields."""
    from jaxtrain.arguments import TrainingArguments
    from jaxtrain.cli import run_config
    from jaxtrain.config import tables as checks
    from jaxtrain.config.tables import OPTIMIZERS, REMAT_POLICIES, SCHEDULERS, TRUNCATION_MODES
    from jaxtrain.models import LlamaConfig
    from jaxtrain.tasks import TASKS, get_task

    arguments_class = TrainingArguments if task is None else get_task(task).arguments

    choices = {
        "optimizer": OPTIMIZERS,
        "scheduler": SCHEDULERS,
        "dtype": checks.DTYPES,
        "param_dtype": checks.DTYPES,
        "gradient_checkpointing": REMAT_POLICIES,
        "progress_bar": checks.PROGRESS_BARS,
        "evaluation_strategy": checks.EVALUATION_STRATEGIES,
        "truncation_mode": TRUNCATION_MODES,
        "on_nan": checks.ON_NAN,
        "report_to": checks.REPORT_TO,
    }
    demo = run_config.DEFAULT_CONFIG
    which = "" if task is None else f" --task {task}"
    task_fields = task_fields_help(task)
    task_text = (
        f"Task fields ({'every task' if task is None else 'this task'}; "
        f"`jaxtrain train --task TASK --help` shows one):\n{task_fields}\n\n"
        if task_fields
        else ""
    )
    return f"""usage: jaxtrain train{which} [CONFIG.yaml|json] [--field value ...] [--model.field value]
                      [--data.field value] [--sample.field value] [--dry_run]
                      [--task {"|".join(TASKS)}]

Train a model. With no CONFIG and no --model.pretrained the demo's settings are the base
(a small Llama on the embedded corpus: `jaxtrain train` alone runs the demo); with a CONFIG
or --model.pretrained the defaults below are. The CONFIG file overrides the base, flags
override the file. Values are written `--field value` or `--field=value`; lists as a,b.

  --dry_run
      Print the mesh, per-device memory and every parameter's sharding; train nothing.
  -h, --help
      Show this message.

  --task STR  (default: 'lm')
      The trainer: {task_names()} (distill: --teacher.pretrained DIR; grpo: --reward FN).

{arguments_class.__name__} (--field value, or `field: value` at the top of CONFIG):
{dataclass_help(arguments_class, choices=choices, only=base_fields(arguments_class))}

{task_text}
model section (--model.field value; LlamaConfig fields; vocab_size and special token ids
follow the tokenizer unless set):
  --model.pretrained DIR
      Fine-tune the local Hugging Face model in DIR (its config.json is the architecture).
{dataclass_help(LlamaConfig, prefix="model.")}

data section (--data.field value):
{schema_help(run_config.DATA_KEYS, schema_docs(run_config, "DATA_KEYS"), "data.", demo["data"])}

sample section (--sample.field value; the sample printed when training ends):
{schema_help(run_config.SAMPLE_KEYS, schema_docs(run_config, "SAMPLE_KEYS"), "sample.", {})}
"""


def base_fields(cls: type) -> set[str]:
    """The TrainingArguments fields of `cls` (its defaults may differ: SFTArguments)."""
    from jaxtrain.arguments import TrainingArguments

    return {f.name for f in dataclasses.fields(TrainingArguments)} & {
        f.name for f in dataclasses.fields(cls)
    }


def task_of(tokens: list[str]) -> str | None:
    """The value of `--task X` / `--task=X` among `tokens`, else None."""
    for index, token in enumerate(tokens):
        if token.startswith("--task="):
            return token.split("=", 1)[1]
        if token == "--task" and index + 1 < len(tokens):
            return tokens[index + 1]
    return None


PLAN_HELP = """usage: jaxtrain plan [CONFIG.yaml] [--hf_config config.json] [--devices N]
                     [--accelerator h100|h200|a100|v5e|v5p|v6e] [--topology AxB[xC]]
                     [--compiler auto|cpu] [--processes P] [--sweep | --choices]
                     [--layers auto|all|unit] [--output plan.json] [--field value ...]

Compile the run's train step for N devices (from shapes alone: nothing is allocated) and read
per-device memory, FLOPs and collectives from the compiled program; add a roofline estimate
of the step time and MFU on the accelerator. Every `jaxtrain train` field (mesh, batch,
sequence, dtype, remat, optimizer, accumulation) is read as for a run. The compiler is the
target's own where this machine has it (XLA:TPU with the `tpu` extra; XLA:GPU with the CUDA
plugin and a GPU), else XLA:CPU on N virtual devices; the plan says which, and why.

  --hf_config PATH     a Hugging Face config.json (configs/ ships Llama-3 8B/70B, Mixtral,
                       Gemma-2-27B); default: the config's model section
  --devices INT        target device count (default: one node of the accelerator)
  --accelerator STR    spec table in jaxtrain/planning/accelerators.py (default: h100)
  --topology STR       a TPU slice's chips (v5e, v6e: 2x4, 16x16; v5p: 2x2x2, 4x8x8): the
                       TPU compiler compiles for it with no TPU attached
  --compiler STR       auto (default): the target's compiler when there is one; cpu: XLA:CPU
  --processes INT      hosts (default: devices / devices per node); sets the link classes
  --sweep              plan every (dp, fsdp, ep, tp) mesh that divides the devices, ranked
  --choices            plan the run's mesh as configured and with scan_layers, mu_dtype and
                       fp8_matmuls each changed alone: memory and time of each
  --layers STR         all: compile every layer; unit: the repeating unit of layers, twice
                       and three times, scaled to the depth; auto (default): unit above 4
                       layers
  --output PATH        where plan.json goes (default: OUTPUT_DIR/plan.json when the command
                       sets --output_dir, else ./plan.json); the path is printed
"""


def command_help(command: str, tokens: list[str] | None = None) -> str:
    """`jaxtrain COMMAND --help` (`tokens`: the rest of the line, e.g. `--task dpo`)."""
    if command == "train":
        return train_help(task_of(tokens or []))
    from jaxtrain.cli import run_config
    from jaxtrain.cli.evaluate import EVALUATE_HELP

    sample = schema_help(run_config.SAMPLE_KEYS, schema_docs(run_config, "SAMPLE_KEYS"), "", {})
    # eval, sample and export restore onto the devices present (cli/run_dir.py restore_runtime).
    mesh = """  --sharding_axis_dims DP,FSDP,EP,TP,SP
      The mesh to restore onto (default: the run's where it fits the devices here, else all
      of them on fsdp, e.g. 1,-1,1,1,1, or one device; a line says so).
"""
    texts = {
        "eval": f"""usage: jaxtrain eval RUN_DIR [--checkpoint PATH|STEP] [--max_eval_batches N]

Evaluate a run's checkpoint (default: its newest) on the run's eval data.

  --checkpoint PATH|STEP
      A step directory <run>/checkpoints/<step>, or its step number (default: the newest
      committed one).
  --max_eval_batches INT
      Cap on eval batches (default: the run's max_eval_batches).
{mesh}""",
        "sample": f"""usage: jaxtrain sample RUN_DIR [--checkpoint PATH|STEP] [--field value ...]

Generate text from a run's checkpoint (default: its newest) with the run's tokenizer.

  --checkpoint PATH|STEP
      A step directory <run>/checkpoints/<step>, or its step number (default: the newest
      committed one).
{mesh}{sample}
""",
        "export": f"""usage: jaxtrain export RUN_OR_CHECKPOINT OUT_DIR [--max_shard_size 5GB] [--dtype bfloat16]
                       [--lora_format merged|peft]

Write a run's checkpoint as a Hugging Face directory (safetensors, config, tokenizer, card).

  --max_shard_size STR  (default: '5GB')
      Largest safetensors shard.
  --dtype STR
      Cast the weights to float32, bfloat16 or float16 (default: as trained).
  --lora_format merged|peft  (default: merged)
      A LoRA run's adapters merged into the base weights, or (peft) a PEFT adapter
      directory on the run's base (what peft's PeftModel and `jaxtrain serve --lora` load).
{mesh}""",
        "report": """usage: jaxtrain report RUN_DIR

Write RUN_DIR/report.png and report.html from the run's metrics.jsonl.
""",
        "plan": PLAN_HELP,
        "serve": SERVE_HELP,
        "evaluate": EVALUATE_HELP,
    }
    return texts[command]


SERVE_HELP = """usage: jaxtrain serve MODEL_OR_RUN_DIR [--host 127.0.0.1] [--port 8000] [--api_key KEY]
                      [--max_slots 8] [--page_size 16] [--max_length N] [--num_pages N]
                      [--model_name NAME] [--max_queue 128] [--request_timeout 600]
                      [--warm_up true] ...

Serve a model over an OpenAI-compatible HTTP API (/v1/models, /v1/completions,
/v1/chat/completions; streaming, n > 1, usage; GET /health and GET /metrics): a run
directory (its newest checkpoint), a Hugging Face directory or .gguf file, or a LoRA export
(merged onto its local base). Needs the serve extra (fastapi, uvicorn). SIGTERM drains:
new requests get 503, the running ones finish, then the process exits 0.

  --host STR  (default: '127.0.0.1')
      Any address but loopback needs --api_key (or --allow_unauthenticated true).
  --port INT  (default: 8000)
  --api_key KEY  (default: $JAXTRAIN_API_KEY)
      Every request but GET /health needs 'Authorization: Bearer KEY' (else 401).
  --allow_unauthenticated BOOL  (default: false)
      Bind a non-loopback host without a key.
  --max_slots INT  (default: 8)
      Sequences decoded at once; more requests wait in the queue.
  --page_size INT  (default: 16)
      Tokens per page of the KV cache.
  --max_length INT
      Prompt + new tokens of one sequence (default: the model's context).
  --num_pages INT
      Pages of the KV cache (default: every slot at max_length, or what a budget allows).
  --kv_cache_gib FLOAT
      The KV cache's memory budget; past it, the youngest sequences are preempted and
      recomputed later.
  --memory_fraction FLOAT
      The budget as a fraction of the GPU's or TPU's free memory (not on CPU).
  --prefill_tokens INT  (default: 512)
      Tokens one prefill call writes: a long prompt goes in chunks of this, between decodes.
  --speculative_tokens INT  (default: 0)
      Draft up to this many tokens by n-gram prompt lookup and verify them in one step
      (outputs unchanged).
  --decode_steps INT  (default: 1)
      Decode up to this many tokens per compiled call (host work paid once per call;
      tokens unchanged).
  --attention auto|gather|pallas|interpret  (default: auto, the gather path)
      How decode steps read the KV pages: pallas reads them in place (GPU, TPU).
  --max_images INT  (default: 1)
      Images one request may carry (a vision-language model).
  --lora NAME=ADAPTER_DIR[,NAME=ADAPTER_DIR...]
      PEFT LoRA adapters served on the model, each under its name: a request's "model"
      picks the base or an adapter.
  --model_name NAME
      The model's id in requests (default: the directory's name).
  --max_body_bytes INT  (default: 4194304)
      A larger request body gets 413.
  --max_prompt_tokens INT
      A longer prompt gets 400 (default: the context).
  --max_tokens INT
      A larger max_tokens gets 400 (default: the context).
  --max_n INT
      A larger n gets 400 (default: max_slots).
  --max_stop INT  (default: 4)
      More stop strings get 400.
  --max_stop_length INT  (default: 128)
      A longer stop string (characters) gets 400.
  --max_queue INT  (default: 128)
      Past this many requests waiting for a slot, 429 with Retry-After.
  --request_timeout FLOAT  (default: 600)
      Seconds from arrival to the last token; past it the request is cancelled and
      answered 504 (an error event if it streams). 0: no timeout.
  --warm_up BOOL  (default: true)
      Compile every prefill and decode shape before the port opens (prompts up to
      --max_prompt_tokens), so serving compiles nothing; false starts sooner and the first
      request of each new shape pays its compile.
  --compilation_cache_dir auto|DIR|null  (default: auto, $JAXTRAIN_CACHE/xla)
      JAX's persistent compilation cache: a restart loads the warm-up's programs instead
      of compiling them again. JAX_COMPILATION_CACHE_DIR, when set, wins.
"""
