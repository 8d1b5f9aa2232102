"""A whole run described by one mapping: TrainingArguments fields plus model/data/sample sections.

```yaml
learning_rate: 1e-3          # any TrainingArguments field at top level
model: {hidden_size: 256, num_hidden_layers: 4, ...}   # LlamaConfig fields
data: {source: default, vocab_size: 4096}              # or train_files / eval_files / tokenizer
sample: {prompt: "def ", max_new_tokens: 80}
```
The CLI resolves file + `--flags` into this mapping and saves it as `<output_dir>/config.yaml`,
so `jaxtrain eval RUN_DIR` can rebuild the same model and data. The demo's settings are the
base only when no config file and no `model.pretrained` are given (`uses_demo`).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import re
import typing
from pathlib import Path
from typing import Any

import yaml

from jaxtrain.arguments import ArgumentError, TrainingArguments
from jaxtrain.config.mixture import check_mixture_names, parse_mixture_weights
from jaxtrain.config_values import coerce_value

SECTIONS = ("model", "data", "sample", "teacher")

# The demo: a small Llama on the embedded corpus, ~10 minutes on 2 CPU cores.
DEFAULT_CONFIG: dict[str, Any] = {
    "output_dir": "runs/demo",
    "learning_rate": 3e-3,
    "scheduler": "cosine",
    "warmup_steps": 30,
    "weight_decay": 0.1,
    "max_steps": 600,
    "total_batch_size": 16,
    "gradient_accumulation_steps": 1,
    "max_sequence_length": 256,
    "logging_steps": 10,
    "eval_steps": 150,
    "max_eval_batches": 16,
    # Small and fast beats big and slow on a 10-minute CPU budget: this model sees ~2.4M
    # tokens and reaches a lower eval loss than a 4M-parameter one in the same time.
    "model": {  # vocab_size and special token ids follow the tokenizer unless set here
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": True,
    },
    "data": {"source": "default", "vocab_size": 4096, "max_train_bytes": 8_000_000},
    "sample": {"prompt": "def ", "max_new_tokens": 120, "temperature": 0.7, "top_k": 40},
}

DATA_KEYS = {
    "source": str,  # "default" (embedded stdlib corpus) or "files"
    "max_train_bytes": int,
    "vocab_size": int,  # of the tokenizer trained on the embedded corpus
    "train_files": str,  # path or glob of jsonl/json/parquet/csv/txt
    "eval_files": str,
    "tokenizer": str,  # local directory of a Hugging Face tokenizer
    "mixture": list,  # the train data as a weighted mixture of files (MIXTURE_KEYS each)
}
# One source of `data.mixture`: its files, weight and settings of its own (data.mixture.Source).
MIXTURE_KEYS = {
    "name": str,  # required: the source's name in logs (mixture/<name>/loss) and weights
    "files": str,  # required: path or glob of jsonl/json/parquet/csv/txt
    "weight": float,  # or TrainingArguments.mixture_weights (stages)
    "text_column": str,
    "messages_column": str,
    "completion_only_loss": bool,
    "chat_template": str,
    "ids_to_pop_from_dataset": list,
    "streaming": bool,
}
SAMPLE_KEYS = {
    "prompt": str,  # default: taken from the run's data (chat template for chat rows)
    "image": str,  # a vision-language model's run: the path of an image the prompt is about
    "max_new_tokens": int,  # tokens to generate (default 64; 0 = no sample)
    "temperature": float,  # 0 = greedy (default)
    "top_k": int,  # sample from the k most likely tokens
    "top_p": float,  # nucleus sampling: the smallest set holding this probability
}


def parse_overrides(tokens: list[str]) -> dict[str, str]:
    """`--key value` / `--key=value` pairs (dotted keys address sections) -> {key: raw}."""
    overrides: dict[str, str] = {}
    index = 0
    while index < len(tokens):
        token = tokens[index]
        if not token.startswith("--") or token == "--":
            raise ArgumentError(f"Expected --key value, got {token!r}.")
        key = token[2:]
        if "=" in key:
            key, value = key.split("=", 1)
        else:  # a value never starts with "--" (`--key=--text` sends one that does)
            if index + 1 >= len(tokens) or tokens[index + 1].startswith("--"):
                raise ArgumentError(f"--{key} needs a value, e.g. --{key} {example_value(key)}.")
            index += 1
            value = tokens[index]
        overrides[key] = value
        index += 1
    return overrides


# An example value per type, for a flag given without one.
EXAMPLES = {int: "100", float: "1e-3", bool: "true", str: "VALUE"}


def example_value(key: str) -> str:
    """An example value of the type of TrainingArguments field (or section key) `key`."""
    section, _, field = key.partition(".")
    schemas = {"data": DATA_KEYS, "sample": SAMPLE_KEYS}
    if field:
        kind = schemas.get(section, {}).get(field)
    else:
        kind = typing.get_type_hints(TrainingArguments).get(key)
        options = [t for t in typing.get_args(kind) if t is not type(None)]
        kind = options[0] if options else kind
    return EXAMPLES.get(kind, "VALUE")


# Where a value of the resolved config came from (`resolve_config_with_sources`).
DEMO, FLAG = "demo", "command line"


def uses_demo(path: str | None, overrides: dict[str, str]) -> bool:
    """The merge rule: the demo's settings (DEFAULT_CONFIG) are the base only when neither a
    config file nor `model.pretrained` is given, so `jaxtrain train --max_steps 100` is a
    shorter demo, while a config file starts from the TrainingArguments and LlamaConfig
    defaults (a YAML of three lines means those three values and the defaults)."""
    if path is not None:
        return False
    return "model.pretrained" not in overrides


def resolve_config(
    path: str | None, overrides: dict[str, str], base: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Base <- config file <- command-line overrides, sections merged per key."""
    return resolve_config_with_sources(path, overrides, base)[0]


def resolve_config_with_sources(
    path: str | None, overrides: dict[str, str], base: dict[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, str]]:
    """-> (config, {"key" or "section.key": where its value came from}).

    The base is `base` if given, else the demo (see `uses_demo`), else only
    `data: {source: default}`; fields absent from the result take their defaults.
    """
    if base is None:
        base = DEFAULT_CONFIG if uses_demo(path, overrides) else {"data": {"source": "default"}}
        label = DEMO if base is DEFAULT_CONFIG else "default"
    else:
        label = "base"
    config = copy.deepcopy(base)
    sources = dict.fromkeys(_flat_keys(config), label)
    if path is not None:
        from jaxtrain.config_values import read_config_file

        update = read_config_file(path)
        _merge(config, update)
        sources.update(dict.fromkeys(_flat_keys(update), str(path)))
    for key, raw in overrides.items():
        section, _, field = key.partition(".")
        if field:
            if section not in SECTIONS:
                raise ArgumentError(
                    f"--{key}: unknown section {section!r}; sections are {', '.join(SECTIONS)}."
                )
            # Kept raw: each field's declared type parses it (YAML would strip a prompt's spaces).
            config.setdefault(section, {})[field] = raw
        else:
            config[key] = raw
        sources[key] = FLAG
    return config, sources


def _flat_keys(config: dict[str, Any]) -> list[str]:
    keys = []
    for key, value in config.items():
        if key in SECTIONS and isinstance(value, dict):
            keys.extend(f"{key}.{field}" for field in value)
        else:
            keys.append(key)
    return keys


def describe_sources(config: dict[str, Any], sources: dict[str, str]) -> str:
    """One line per origin: which values came from the demo, the file, the command line."""
    by_source: dict[str, list[str]] = {}
    for key, source in sources.items():
        section, _, field = key.partition(".")
        value = config[section][field] if field else config[key]
        by_source.setdefault(source, []).append(
            f"{key}={value!r}" if isinstance(value, str) and " " in value else f"{key}={value}"
        )
    lines = [f"config from {source}: {', '.join(items)}" for source, items in by_source.items()]
    lines.append("config: every other field has its default (jaxtrain train --help)")
    return "\n".join(lines)


def explain_source(err: ArgumentError, sources: dict[str, str]) -> ArgumentError:
    """The same error, saying which of the values it names came from the demo's settings
    (the one origin a user did not write down). Not for names a user wrote that do not
    exist: a suggested spelling would read as one of them."""
    from jaxtrain.arguments import UnknownFieldError

    if isinstance(err, UnknownFieldError):
        return err
    message = str(err)
    demo = [
        key for key, source in sources.items()
        if source == DEMO and re.search(rf"\b{re.escape(key.rpartition('.')[2])}\b", message)
    ]  # fmt: skip
    if not demo:
        return err
    named = ", ".join(demo)
    return type(err)(
        f"{message} ({named} came from the demo's settings, used because no config file "
        "was given; override it with --" + demo[0] + ")"
    )


def _merge(config: dict[str, Any], update: dict[str, Any]) -> None:
    for key, value in update.items():
        if key in SECTIONS and isinstance(value, dict):
            config.setdefault(key, {}).update(value)
        else:
            config[key] = value


def split_config(
    config: dict[str, Any],
    source: str = "the config",
    sources: dict[str, str] | None = None,
    task_check: Any = None,
) -> tuple[TrainingArguments, dict, dict, dict]:
    """-> (TrainingArguments, model section, data section, sample section), all validated.
    `task_check(config)`, when given, runs once the keys are known to belong to the task and
    before the arguments are built (`jaxtrain train`: what the task needs from the data)."""
    from jaxtrain.tasks import DEFAULT_TASK, check_task_fields, get_task

    fields = {k: v for k, v in config.items() if k not in SECTIONS and k != "task"}
    # `task` (sft, dpo, reward, distill) picks the arguments class: DPOArguments has beta...
    task = str(config.get("task") or DEFAULT_TASK)
    arguments_class = get_task(task).arguments
    check_task_fields(list(fields), task, source)
    if task_check is not None:
        task_check(config)
    # The light sections first: their errors come before the arguments' and the model's
    # checks import JAX.
    data = typed_section(config.get("data") or {}, DATA_KEYS, "data", sources)
    sample = typed_section(config.get("sample") or {}, SAMPLE_KEYS, "sample", sources)
    check_data_section(data)
    check_sample_section(sample)
    if "mixture" in data:
        data["mixture"] = typed_mixture(data["mixture"], sources)
        fields = mixture_fields(fields, data["mixture"])
    args = arguments_class.from_dict(fields, source="config", sources=sources)
    if "mixture" in data:  # every name known before any file is read
        stages = parse_mixture_weights(args.mixture_weights)
        check_mixture_names(stages, [e["name"] for e in data["mixture"]], "data.mixture")
    model = typed_model_section(config.get("model") or {}, sources)
    return args, model, data, sample


def typed_mixture(entries: Any, sources: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """`data.mixture`'s entries parsed by MIXTURE_KEYS: each names its source and files."""
    if not isinstance(entries, list) or not entries:
        raise ArgumentError(
            "data.mixture must be a list of sources, e.g. [{name: web, files: 'web/*.jsonl', "
            "weight: 0.7}, {name: code, files: 'code/*.jsonl', weight: 0.3}]."
        )
    typed, names = [], []
    for i, entry in enumerate(entries):
        where = f"data.mixture[{i}]"
        if not isinstance(entry, dict):
            raise ArgumentError(f"{where} must be a mapping with name and files, got {entry!r}.")
        entry = typed_section(entry, MIXTURE_KEYS, where, sources)
        for key in ("name", "files"):
            if not entry.get(key):
                raise ArgumentError(f"{where} needs {key} (e.g. {key}: {_EXAMPLE_ENTRY[key]}).")
        if entry["name"] in names:
            raise ArgumentError(f"{where}: the name {entry['name']!r} is used twice; rename one.")
        names.append(entry["name"])
        typed.append(entry)
    return typed


_EXAMPLE_ENTRY = {"name": "web", "files": "'data/web-*.jsonl'"}


def mixture_fields(fields: dict[str, Any], entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The arguments with the entries' weights as mixture_weights (weights given once: on
    the entries, or as mixture_weights for stages)."""
    weights = {e["name"]: e["weight"] for e in entries if e.get("weight") is not None}
    if not weights:
        return fields
    given = fields.get("mixture_weights")
    if isinstance(given, str):  # from a flag
        given = yaml.safe_load(given)
    if given is not None and given != weights:  # a run's config.yaml holds both, equal
        raise ArgumentError(
            "data.mixture gives weights and so does mixture_weights; give them once (stages "
            "in mixture_weights, or a weight per data.mixture entry)."
        )
    return {**fields, "mixture_weights": weights}


# The embedded corpus's byte-level BPE holds the 256 byte tokens and its 2 special tokens.
SMALLEST_CORPUS_VOCAB = 258


def check_data_section(data: dict[str, Any]) -> None:
    """Values of the data section that would fail only once the data is read."""
    if "mixture" in data and "train_files" in data:
        raise ArgumentError(
            "data.train_files and data.mixture both give the train data; use one of them."
        )
    if "mixture" in data or data.get("source", "default") != "default":
        return
    vocab = data.get("vocab_size")
    if vocab is not None and vocab < SMALLEST_CORPUS_VOCAB:
        raise ArgumentError(
            f"data.vocab_size={vocab} is too small for the embedded corpus's byte-level BPE "
            f"(256 byte tokens + 2 special tokens): use --data.vocab_size "
            f"{SMALLEST_CORPUS_VOCAB} or more (default 4096)."
        )
    budget = data.get("max_train_bytes")
    if budget is not None and budget <= 0:
        raise ArgumentError(
            f"data.max_train_bytes={budget} must be > 0, e.g. --data.max_train_bytes 200000."
        )


def check_sample_section(sample: dict[str, Any], flag: str = "--sample.") -> None:
    """The end-of-run sample's values, checked before training rather than after it (and
    `jaxtrain sample`'s before the model loads: `flag` "--", its options' spelling)."""
    checks = [
        ("max_new_tokens", lambda v: v >= 0, ">= 0 (0 = no sample)", "64"),
        ("temperature", lambda v: v >= 0, ">= 0 (0 = greedy)", "0.7"),
        ("top_k", lambda v: v >= 1, ">= 1", "40"),
        ("top_p", lambda v: 0 < v <= 1, "in (0, 1]", "0.9"),
    ]
    for key, ok, rule, example in checks:
        value = sample.get(key)
        if value is not None and not ok(value):
            raise ArgumentError(
                f"{flag.lstrip('-')}{key}={value} must be {rule}, e.g. {flag}{key} {example}."
            )


def _unknown_keys(unknown: list[str], known: list[str], name: str) -> ArgumentError:
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, known, n=1)
        hints.append(f"{name}.{key}" + (f" (did you mean {name}.{close[0]}?)" if close else ""))
    return ArgumentError(
        f"Unknown key(s) in section {name!r}: {', '.join(hints)}. Known: {', '.join(known)}."
    )


def typed_section(
    values: dict, schema: dict[str, type], name: str, sources: dict[str, str] | None = None
) -> dict[str, Any]:
    """A section's keys parsed by `schema`; errors name where a value came from (`sources`)."""
    unknown = sorted(set(values) - set(schema))
    if unknown:
        raise _unknown_keys(unknown, list(schema), name)
    where = sources or {}
    return {
        k: coerce_value(
            schema[k] | None, v, field=f"{name}.{k}", source=where.get(f"{name}.{k}", "config")
        )
        for k, v in values.items()
    }


# Keys of the model section besides LlamaConfig's fields. attention_implementation is set
# on the built model (a call-time attribute, not part of its architecture).
MODEL_EXTRA_KEYS = ("pretrained", "base_model", "attention_implementation")


def typed_model_section(
    values: dict[str, Any], sources: dict[str, str] | None = None
) -> dict[str, Any]:
    """LlamaConfig fields parsed by their declared types and checked together, before any
    data is read: a misspelled key or an inconsistent shape is an ArgumentError."""
    from jaxtrain.models.classes import classes_for

    config_class, _ = classes_for(values.get("model_type"))  # MoE types have more fields
    hints = typing.get_type_hints(config_class)
    known = [f.name for f in dataclasses.fields(config_class)] + list(MODEL_EXTRA_KEYS)
    unknown = sorted(k for k in values if k not in known)
    if unknown:
        raise _unknown_keys(unknown, known, "model")
    where = sources or {}
    typed = {  # a nested section (a vision-language model's towers) is its config's to check
        k: coerce_value(hints[k], v, field=f"model.{k}", source=where.get(f"model.{k}", "config"))
        if k in hints and not dataclasses.is_dataclass(hints[k])
        else v
        for k, v in values.items()
    }
    if "pretrained" not in typed:  # a pretrained model's architecture is its config.json
        fields = {k: typed[k] for k in typed if k in hints}
        try:  # vocab_size may still come from the tokenizer: any positive stand-in checks
            if "vocab_size" in hints:
                config_class(**{"vocab_size": 1, **fields})
            else:  # a vision-language model: its decoder's section has the vocabulary
                config_class.from_dict(fields)
        except ValueError as err:
            raise ArgumentError(f"model section: {err}") from None
    return typed


def section_changes(
    saved: dict[str, Any], config: dict[str, Any], sections: tuple[str, ...]
) -> str | None:
    """What `config` changed of `saved`'s task sections (a distillation's teacher), as
    "teacher.pretrained 'a' -> 'b'", or None. A checkpoint holds no frozen model: a resumed
    run builds its teacher from this run's section, which must be said."""
    changed = []
    for name in sections:
        old, new = saved.get(name) or {}, config.get(name) or {}
        for key in sorted(set(old) | set(new)):
            if old.get(key) != new.get(key):
                changed.append(f"{name}.{key} {old.get(key)!r} -> {new.get(key)!r}")
    return ", ".join(changed) or None


def save_config(config: dict[str, Any], output_dir: str | Path) -> Path:
    path = Path(output_dir) / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path
