"""What a new user still tripped over (issue 41): each item with the check that would have
caught it. Real CLI runs, in-process where JAX may already be loaded, at a tiny size."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from flax import nnx
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import PreTrainedTokenizerFast

from jaxtrain.cli import main
from jaxtrain.cli.plan import plan_path, split_plan_options
from jaxtrain.cli.run_config import parse_overrides, resolve_config_with_sources, split_config
from jaxtrain.errors import ArgumentError
from jaxtrain.models.lora import apply_lora, default_targets, lora_projections
from jaxtrain.models.moe import MoeConfig, MoeForCausalLM

ROOT = Path(__file__).parents[1]


# ------------------------------------------------ the end-of-run sample
WORDS = 30  # fewer tokens than the demo sample's top_k (40)


def word_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, "</s>": 1, "<s>": 2} | {f"w{i}": i for i in range(3, WORDS)}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token="</s>", pad_token="<unk>"
    )


@pytest.fixture(scope="module")
def word_files(tmp_path_factory) -> Path:
    """A 30-token word-level tokenizer (fewer tokens than the demo sample's top_k 40) and
    text rows in its words."""
    root = tmp_path_factory.mktemp("words")
    word_tokenizer().save_pretrained(root / "tok")
    rows = [" ".join(f"w{3 + (i * 7 + j) % 27}" for j in range(12)) for i in range(64)]
    (root / "train.jsonl").write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    return root


def word_run(word_files: Path, output_dir: Path, *extra: str) -> list[str]:
    return [
        "train", "--data.source", "files", "--data.train_files", str(word_files / "train.jsonl"),
        "--data.tokenizer", str(word_files / "tok"), "--output_dir", str(output_dir),
        "--max_steps", "2", "--warmup_steps", "0", "--total_batch_size", "4",
        "--max_sequence_length", "16", "--model.hidden_size", "32",
        "--model.intermediate_size", "64", "--model.num_hidden_layers", "1",
        "--progress_bar", "none", "--run_report", "false", "--sample.max_new_tokens", "6",
        *extra,
    ]  # fmt: skip


def test_the_sample_s_top_k_is_clamped_to_a_small_vocabulary(word_files, tmp_path, capsys):
    # The demo's sample (top_k 40, temperature 0.7) on a 30-token vocabulary: jax.lax.top_k
    # refused k > 30 and a finished run exited 1 with a traceback.
    assert len(word_tokenizer()) == WORDS
    assert main(word_run(word_files, tmp_path / "run")) == 0
    out = capsys.readouterr().out
    assert "sample: top_k 40 is not below the vocabulary's 30 tokens" in out
    assert "--- sample" in out and "done (completed)" in out


def test_a_failing_sample_leaves_a_finished_run_finished(word_files, tmp_path, capsys):
    from jaxtrain.cli.commands import cmd_train

    class BreakDecoding:  # a fault in the sample, after the final checkpoint
        def on_train_end(self, trainer, *args):
            def broken(*a, **k):
                raise RuntimeError("decoder exploded")

            trainer.processing_class.decode = broken

    tokens = word_run(word_files, tmp_path / "run")[1:]
    assert cmd_train(tokens, callbacks=[BreakDecoding()]) == 0
    captured = capsys.readouterr()
    assert "done (completed)" in captured.out
    assert (tmp_path / "run" / "checkpoints" / "2").is_dir()
    [line] = [x for x in captured.err.splitlines() if "sample" in x]
    assert "the end-of-run sample failed (RuntimeError: decoder exploded)" in line


def test_the_command_freezes_its_heap_before_training(word_files, tmp_path):
    """`jaxtrain train` moves what lives all run (libraries, data, tokenizer) out of the
    garbage collector's walk before the loop (full collections cost a one-step run 0.4 s), in
    its own process only: a caller's (a notebook, a Tune trial) keeps collecting all."""
    import gc

    from jaxtrain.cli.commands import cmd_train

    frozen = []

    class CountFrozen:
        def on_train_start(self, trainer, state):
            frozen.append(gc.get_freeze_count())

    tokens = word_run(word_files, tmp_path / "run")[1:]
    before = gc.get_freeze_count()
    assert cmd_train(tokens, callbacks=[CountFrozen()], own_process=True) == 0
    assert frozen and frozen[0] > before
    frozen.clear()
    before = gc.get_freeze_count()
    assert cmd_train([*tokens, "--output_dir", str(tmp_path / "again")], [CountFrozen()]) == 0
    assert frozen and frozen[0] <= before


def test_bad_sample_values_are_refused_before_training():
    config, _ = resolve_config_with_sources(None, parse_overrides(["--sample.top_k", "0"]))
    with pytest.raises(ArgumentError, match=r"sample.top_k=0 must be >= 1, e.g. --sample.top_k"):
        split_config(config)


# ------------------------------------------------ data.vocab_size
def test_a_too_small_corpus_vocabulary_names_the_smallest_that_works(capsys):
    assert main(["train", "--data.vocab_size", "256"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--data.vocab_size 258 or more" in err


# ------------------------------------------------ grpo on the command line
def test_grpo_on_the_default_data_says_what_to_pass_on_the_command_line(capsys):
    assert main(["train", "--task", "grpo"]) == 2
    err = capsys.readouterr().err
    assert "dataset_eval" not in err
    assert "--data.train_files PROMPTS.jsonl" in err and "--reward" in err
    files = ["--data.source", "files", "--data.train_files", "p.jsonl"]
    assert main(["train", "--task", "grpo", *files]) == 2
    assert "--task grpo needs reward functions: --reward" in capsys.readouterr().err
    # Eval prompts are taken (once refused: "drop --data.eval_files"); the rewards still lack.
    assert main(["train", "--task", "grpo", *files, "--data.eval_files", "e.jsonl"]) == 2
    assert "--task grpo needs reward functions: --reward" in capsys.readouterr().err
    # Without a tokenizer it once failed inside the trainer, naming no flag.
    assert main(["train", "--task", "rloo", *files, "--reward", "last_number_matches"]) == 2
    assert "set --data.tokenizer DIR" in capsys.readouterr().err


def test_a_preference_task_on_files_without_a_tokenizer_names_the_flags(capsys):
    # It once failed on the first row with the Python API's advice (processing_class=...).
    files = ["--data.source", "files", "--data.train_files", "pairs.jsonl"]
    for task in ("reward", "dpo", "kto", "orpo", "cpo"):
        assert main(["train", "--task", task, *files]) == 2
        err = capsys.readouterr().err
        assert f"--task {task} tokenizes the text of its rows: set --data.tokenizer DIR" in err
        assert "processing_class" not in err and err.count("\n") == 1


def test_help_names_grpo_and_its_own_loss_types(capsys):
    assert main(["--help"]) == 0
    assert "|grpo|" in capsys.readouterr().out  # the usage's --task list
    assert main(["train", "--task", "grpo", "--help"]) == 0
    text = capsys.readouterr().out
    from jaxtrain.tasks import TASKS

    names = list(TASKS)
    assert f"The trainer: {', '.join(names[:-1])} or {names[-1]}" in text
    loss_type = text.split("--loss_type STR", 1)[1].split("\n  --", 1)[0]
    assert "One of: grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo." in loss_type
    assert "sigmoid" not in loss_type
    assert main(["train", "--task", "dpo", "--help"]) == 0
    assert "One of: sigmoid, ipo, hinge." in capsys.readouterr().out


# ------------------------------------------------ jaxtrain plan
def test_plan_json_goes_to_the_output_dir_the_command_names():
    def where(*tokens: str) -> Path:
        options, rest = split_plan_options(list(tokens))
        config, sources = resolve_config_with_sources(None, parse_overrides(rest))
        return plan_path(options, split_config(config)[0], sources)

    assert where() == Path("plan.json")  # the demo's runs/demo is not named by the command
    assert where("--output_dir", "runs/big") == Path("runs/big/plan.json")
    assert where("--output_dir", "runs/big", "--output", "p.json") == Path("p.json")


def test_ctrl_c_during_plan_is_one_line_and_130(tmp_path):
    command = [sys.executable, "-m", "jaxtrain.cli", "plan", "--devices", "2", "--layers", "all"]
    command += ["--model.num_hidden_layers", "24", "--output_dir", str(tmp_path)]  # a long compile
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "TMPDIR": str(scratch)}
    # A session of its own: killpg below is the terminal's Ctrl-C to the foreground group.
    plan = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    child = _compile_child(plan)
    os.killpg(plan.pid, signal.SIGINT)
    stdout, stderr = plan.communicate(timeout=120)
    assert plan.returncode == 130, stderr[-3000:]
    assert stderr.strip().splitlines() == [
        "jaxtrain plan: interrupted by SIGINT; nothing was written"
    ]
    assert _ends(child)  # the compile did not outlive the command
    assert not (tmp_path / "plan.json").exists()
    assert list(scratch.iterdir()) == []  # nor did the compile's spec


# Ctrl-C lands the moment the compile process exists, before Popen has returned it: the
# window where the command line's generic line once won on a loaded CI machine.
_CTRL_C_AS_THE_CHILD_STARTS = """
import os, signal, subprocess, sys
from jaxtrain import interrupts
from jaxtrain.planning.child import run_child

started = subprocess.Popen
def popen_then_ctrl_c(*args, **kwargs):
    child = started(*args, **kwargs)
    print(child.pid, flush=True)
    os.kill(os.getpid(), signal.SIGINT)
    return child
subprocess.Popen = popen_then_ctrl_c
interrupts.install("jaxtrain plan")
run_child("jaxtrain.planning.worker", {}, 1, label="jaxtrain plan")
"""


def test_ctrl_c_as_the_compile_process_starts_still_ends_it_with_the_plan_s_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "TMPDIR": str(tmp_path)}
    command = [sys.executable, "-c", _CTRL_C_AS_THE_CHILD_STARTS]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 130, done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == [
        "jaxtrain plan: interrupted by SIGINT; nothing was written"
    ]
    assert _ends(int(done.stdout.split()[0]))
    assert list(tmp_path.iterdir()) == []  # the compile's spec went with it


def _ends(pid: int, timeout: float = 30.0) -> bool:
    """Whether process `pid` is gone (or a zombie waiting for its reaper) within `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] == "Z":
                return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.05)
    return False


def _compile_child(process: subprocess.Popen, timeout: float = 120.0) -> int:
    """The pid of `jaxtrain plan`'s compile process, once it has loaded jaxlib."""
    deadline = time.monotonic() + timeout
    children = Path(f"/proc/{process.pid}/task/{process.pid}/children")
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[1][-2000:]
        pids = children.read_text().split()
        if pids and "jaxlib" in Path(f"/proc/{pids[0]}/maps").read_text():
            return int(pids[0])
        time.sleep(0.05)
    raise AssertionError("the compile process never started")


# ------------------------------------------------ LoRA on a mixture-of-experts model
def moe(**overrides) -> MoeForCausalLM:
    config = MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
        **overrides,
    )  # fmt: skip
    return MoeForCausalLM(config, rngs=nnx.Rngs(0))


def test_lora_s_default_targets_of_a_moe_model_are_ones_that_work():
    model = moe()
    assert default_targets(model) == ["attention"]  # its experts take no adapter
    apply_lora(model, rank=2, alpha=4.0)  # the default: no error
    paths = ["/".join(map(str, path)) for path, _ in lora_projections(model)]
    assert sorted(p.rsplit("/", 1)[1] for p in paths) == ["o_proj"] * 2 + ["qkv_proj"] * 2
    # A shared expert is an MLP outside the experts: the default adapts it too.
    shared = moe(shared_expert_intermediate_size=32)
    assert default_targets(shared) == ["attention", "mlp"]
    apply_lora(shared, rank=2, alpha=4.0)
    assert any("shared_expert" in str(path) for path, _ in lora_projections(shared))


def test_lora_mlp_on_experts_names_a_target_that_works():
    with pytest.raises(ArgumentError) as caught:
        apply_lora(moe(), rank=2, alpha=4.0, targets=["mlp"])
    message = str(caught.value)
    assert "expert weights of a mixture-of-experts model take no adapter" in message
    hint = message.split("targets that do:", 1)[1]
    assert "'mlp'" not in hint and "--lora_targets attention" in hint


# ------------------------------------------------ a reward module beside the data
def test_a_reward_module_in_the_current_directory_loads_from_the_console_script(
    tmp_path, monkeypatch
):
    from jaxtrain.trainers.rewards import load_reward

    (tmp_path / "issue41_rewards.py").write_text(
        "def one(prompts, completions, **_):\n    return [1.0] * len(completions)\n"
    )
    monkeypatch.chdir(tmp_path)
    # The `jaxtrain` console script's sys.path: no "" and not the current directory.
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    reward = load_reward("issue41_rewards:one")
    assert reward(prompts=["a"], completions=["b", "c"]) == [1.0, 1.0]
    assert str(tmp_path) not in sys.path  # borrowed for the import only
