"""`jaxtrain eval | sample | export RUN_DIR` on a run directory of every task: each restores
the run's model from its checkpoint (without the task's training data: a GRPO run, whose
trainer needs its prompts, once could not be sampled or exported), eval reports the task's
own metrics, and a command that makes no sense for a task says so in one line."""

from __future__ import annotations

import json

import pytest
from test_cli_tasks import MODEL, config, files, write_rows  # noqa: F401 (files: a fixture)

from jaxtrain.cli import main
from jaxtrain.tasks import TASKS

# task -> (its rows, its settings, metrics of its own that eval reports; (): no eval set)
RUNS = {
    "lm": ("text", {}, ("eval/perplexity",)),
    "sft": ("sft", {}, ("eval/perplexity",)),
    "dpo": ("pairs", {"beta": 0.2}, ("eval/rewards/margins",)),
    "reward": ("pairs", {}, ("eval/rewards/chosen",)),
    "distill": ("sft", {"teacher": dict(MODEL), "distill_alpha": 0.7}, ("eval/distill/kl",)),
    "kto": ("pairs", {}, ("eval/kl", "eval/rewards/margins")),
    "orpo": ("pairs", {}, ("eval/nll_loss",)),
    "cpo": ("pairs", {"loss_type": "simpo", "cpo_alpha": 0.0}, ("eval/rewards/margins",)),
    "grpo": (
        "prompts",
        # This session's GRPO options ride along: set from a config file, then taken out.
        {"reward": "last_number_matches", "num_generations": 2, "max_prompt_length": 8,
         "max_completion_length": 3, "sampler_correction": "sequence_mask",
         "dynamic_sampling_passes": 2, "mu_dtype": "bfloat16",
         "max_staleness": 1},
        (),
    ),
    "rloo": (
        "prompts",
        {"reward": "last_number_matches", "num_generations": 2, "max_prompt_length": 8,
         "max_completion_length": 3, "normalize_advantages": True},
        (),
    ),
}  # fmt: skip


def test_every_task_has_a_run_here():
    assert set(RUNS) == set(TASKS)


@pytest.fixture(scope="module")
def run_dirs(files):  # noqa: F811
    """A function task -> its trained run directory (trained at the first request)."""
    root = files["root"]
    texts = [{"text": f"what is {i} + 1 ? {i + 1}"} for i in range(8)]
    prompts = [{"prompt": f"what is {i} + 1 ?", "answer": i + 1} for i in range(8)]
    rows = {**files, "text": write_rows(root / "text.jsonl", texts),
            "prompts": write_rows(root / "prompts.jsonl", prompts)}  # fmt: skip
    trained: dict[str, object] = {}

    def run_dir(task: str):
        if task not in trained:
            kind, extra, metrics = RUNS[task]
            out = root / f"run_dir_{task}"
            settings = {"save_final": True, "output_dir": str(out)}
            if metrics:  # the run evaluates itself: eval must say the same
                settings["evaluation_strategy"] = "steps"
            path = config(rows, task, kind, eval_rows=kind if metrics else None,
                          **extra, **settings)  # fmt: skip
            assert main(["train", path]) == 0
            trained[task] = out
        return trained[task]

    return run_dir


def printed_metrics(out: str) -> dict[str, str]:
    return dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)


@pytest.mark.parametrize("task", list(RUNS))
def test_eval_reports_the_runs_own_final_evaluation(run_dirs, task, capsys):
    run_dir = run_dirs(task)
    metrics = RUNS[task][2]
    capsys.readouterr()
    if not metrics:
        assert main(["eval", str(run_dir)]) == 2
        err = capsys.readouterr().err.strip()
        assert "has no eval set" in err and "jaxtrain evaluate" in err
        assert len(err.splitlines()) == 1
        # The advice works: lm-eval's tasks evaluate the run's policy.
        assert main(["evaluate", str(run_dir), "--tasks", "python_mc", "--limit", "2"]) == 0
        assert "python_mc" in capsys.readouterr().out
        return
    assert main(["eval", str(run_dir)]) == 0
    printed = printed_metrics(capsys.readouterr().out)
    trained = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    steps = [entry for entry in trained if "loss" in entry]
    for metric in metrics:  # in eval's report, and in the run's training logs
        assert metric in printed, printed
        assert metric.removeprefix("eval/") in steps[-1], steps[-1]
    final_eval = [entry for entry in trained if "eval/loss" in entry][-1]
    assert float(printed["eval/loss"]) == pytest.approx(final_eval["eval/loss"], abs=1e-4)
    # exp(loss) is a perplexity only for a token NLL (lm, sft), not for a task's own loss.
    token_nll = task in ("lm", "sft")
    assert ("eval/perplexity" in printed) == token_nll
    assert all(("perplexity" in entry) == token_nll for entry in trained if "loss" in entry)


@pytest.mark.parametrize("task", list(RUNS))
def test_sample_generates_from_the_runs_model(run_dirs, task, capsys):
    run_dir = run_dirs(task)
    capsys.readouterr()
    if task == "reward":
        assert main(["sample", str(run_dir)]) == 2
        err = capsys.readouterr().err.strip()
        assert "reward model" in err and len(err.splitlines()) == 1
        return
    assert main(["sample", str(run_dir), "--max_new_tokens", "4"]) == 0
    assert "--- sample" in capsys.readouterr().out


@pytest.mark.parametrize("task", list(RUNS))
def test_export_writes_the_tasks_kind_of_model(run_dirs, task, capsys):
    run_dir = run_dirs(task)
    out = run_dir.parent / f"export_{task}"
    assert main(["export", str(run_dir), str(out)]) == 0
    step = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    assert f"(step {step})" in capsys.readouterr().out
    exported = json.loads((out / "config.json").read_text())
    kind = "ForSequenceClassification" if task == "reward" else "ForCausalLM"
    assert exported["architectures"][0].endswith(kind)


def test_eval_of_a_run_without_an_eval_set_says_so(run_dirs, capsys):
    import shutil

    import yaml

    run_dir = run_dirs("sft").parent / "run_dir_sft_without_eval"
    shutil.copytree(run_dirs("sft"), run_dir)
    values = yaml.safe_load((run_dir / "config.yaml").read_text())
    values["data"].pop("eval_files")
    (run_dir / "config.yaml").write_text(yaml.safe_dump(values))
    capsys.readouterr()
    assert main(["eval", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert "this run has no eval set" in err and len(err.splitlines()) == 1


def test_eval_takes_max_eval_batches_from_the_command_line(run_dirs, capsys):
    """`jaxtrain eval --max_eval_batches N` limits this evaluation (handed to `evaluate`; it
    once wrote into the restored run's arguments)."""
    run_dir = run_dirs("lm")
    capsys.readouterr()
    assert main(["eval", str(run_dir)]) == 0
    whole = printed_metrics(capsys.readouterr().out)
    assert main(["eval", str(run_dir), "--max_eval_batches", "1"]) == 0
    one = printed_metrics(capsys.readouterr().out)
    assert float(one["eval/batches"]) == 1 < float(whole["eval/batches"])
    for bad in ("0", "-2"):  # it evaluated nothing and exited 0
        assert main(["eval", str(run_dir), "--max_eval_batches", bad]) == 2
        assert "--max_eval_batches must be a positive number" in capsys.readouterr().err


def test_a_checkpoint_is_named_by_its_step_directory_or_its_step_number(run_dirs, capsys):
    """`jaxtrain evaluate` takes a run's step directory as MODEL (as `export` does), and
    `--checkpoint` a step number as well as a step directory."""
    run_dir = run_dirs("lm")
    step = max(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    tables = []
    for model, extra in [
        (run_dir / "checkpoints" / str(step), []),
        (run_dir, ["--checkpoint", str(step)]),
    ]:
        capsys.readouterr()
        assert main(["evaluate", str(model), "--tasks", "python_mc", "--limit", "2", *extra]) == 0
        tables.append(capsys.readouterr().out)
    assert "python_mc" in tables[0] and tables[0] == tables[1]
    assert main(["sample", str(run_dir), "--checkpoint", str(step), "--max_new_tokens", "2"]) == 0
    assert main(["evaluate", str(run_dir / "checkpoints" / str(step)), "--tasks", "python_mc",
                 "--checkpoint", str(step)]) == 2  # fmt: skip
    assert "is a step directory; drop --checkpoint" in capsys.readouterr().err


def test_export_writes_a_lora_run_as_a_peft_adapter(run_dirs, files, capsys):  # noqa: F811
    """`--lora_format peft` from the shell (once Python-only): the adapter directory the
    Trainer's own export writes, and a run without adapters refused in one line."""
    from safetensors.numpy import load_file

    lm = run_dirs("lm")
    capsys.readouterr()
    assert main(["export", str(lm), str(lm.parent / "no_adapters"), "--lora_format", "peft"]) == 2
    err = capsys.readouterr().err.strip()
    assert "has no LoRA adapters" in err and len(err.splitlines()) == 1
    out = files["root"] / "run_dir_lora"
    path = config(files, "sft", "sft", lora_rank=4, save_final=True, output_dir=str(out))
    assert main(["train", path]) == 0
    assert main(["export", str(out), str(out.parent / "peft"), "--lora_format", "peft"]) == 0
    adapter = json.loads((out.parent / "peft" / "adapter_config.json").read_text())
    assert adapter["peft_type"] == "LORA" and adapter["r"] == 4
    tensors = load_file(str(out.parent / "peft" / "adapter_model.safetensors"))
    assert tensors and all(".lora_A." in k or ".lora_B." in k for k in tensors)
