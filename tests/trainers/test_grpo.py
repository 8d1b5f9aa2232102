"""GRPOTrainer: a tiny Llama learns a verifiable toy task, errors before any update, LoRA,
exact resume (at a round boundary and inside a round)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from trainer_fixtures import tiny_arguments, tiny_model

from jaxtrain.arguments import ArgumentError
from jaxtrain.config.sections import RunSettings
from jaxtrain.trainers import GRPOArguments, GRPOTrainer
from jaxtrain.trainers.grpo import check_process_groups
from jaxtrain.trainers.rewards import (
    RewardError,
    format_regex,
    last_number_matches,
    score_completions,
)

BIG = {str(i) for i in range(10, 20)}


def big_first_number(prompts, completions, **_):
    """1 when the completion starts with a number of at least 10 (10 of the 64 tokens)."""
    return [float(bool(c.split()) and c.split()[0] in BIG) for c in completions]


def prompts(n: int = 16) -> list[dict[str, object]]:
    return [
        {"prompt": f"what is {i % 7} + {(3 * i) % 5} ?", "answer": i % 7 + (3 * i) % 5}
        for i in range(n)
    ]


class Logs:
    def __init__(self):
        self.logs: list[dict[str, float]] = []

    def on_log(self, trainer, logs, step):
        self.logs.append(dict(logs))


def grpo_args(tmp_path, **overrides):
    values = dict(
        max_steps=4,
        total_batch_size=16,
        num_generations=4,
        max_prompt_length=8,
        max_completion_length=3,
        learning_rate=1e-2,
    )
    return tiny_arguments(GRPOArguments, tmp_path, **{**values, **overrides})


def test_it_learns_the_toy_task(tokenizer, tmp_path):
    logs = Logs()
    args = grpo_args(tmp_path, max_steps=40, learning_rate=5e-3, beta=0.04, seed=0)
    trainer = GRPOTrainer(
        arguments=args,
        model=tiny_model(),
        reward_funcs=[big_first_number],
        dataset_train=prompts(),
        processing_class=tokenizer,
        callbacks=[logs],
    )
    trainer.train()
    rewards = [entry["reward"] for entry in logs.logs if "reward" in entry]
    assert len(rewards) == 40
    first, last = np.mean(rewards[:10]), np.mean(rewards[-10:])
    print("first", first, "last", last, [round(x, 2) for x in rewards])
    assert last >= 2 * first and last >= first + 0.3
    kls = [entry["kl"] for entry in logs.logs]
    print("kl", [round(k, 2) for k in kls])
    assert max(kls) < 1.0  # beta 0.04 keeps the policy near the reference
    one = logs.logs[-1]
    for key in ("reward_std", "rewards/big_first_number", "frac_reward_zero_std",
                "clip_ratio", "entropy", "completions/mean_length", "completions/min_length",
                "completions/max_length", "completions/clipped_ratio",
                "time/generation_s", "time/training_s"):  # fmt: skip
        assert key in one, key
    # The split: every update takes time (it was once attributed to generation, or to 0).
    assert all(entry["time/training_s"] > 0 for entry in logs.logs[1:])
    assert 0 < one["entropy"] <= np.log(64)  # per-token nats over the 64-token vocabulary


def make(tokenizer, tmp_path, reward, **overrides):
    return GRPOTrainer(
        arguments=grpo_args(tmp_path, **overrides),
        model=tiny_model(),
        reward_funcs=[reward],
        dataset_train=prompts(),
        processing_class=tokenizer,
    )


def raises_on_seven(prompts, completions, **_):
    if any("+" in p for p in prompts):
        raise ZeroDivisionError("no sevens")
    return [0.0] * len(completions)


@pytest.mark.parametrize(
    "reward, match",
    [
        (raises_on_seven, r"raises_on_seven raised ZeroDivisionError: no sevens on prompt "
         r"'what is \d \+ \d \?'"),
        (lambda prompts, completions, **_: [1.0], "returned 1 values for 16 completions"),
        (lambda prompts, completions, **_: [float("nan")] * 16, "returned NaN for prompt"),
        (lambda prompts, completions, **_: [None] * 16, "returned None for every completion"),
    ],
)  # fmt: skip
def test_reward_errors_name_the_function_before_any_update(tokenizer, tmp_path, reward, match):
    trainer = make(tokenizer, tmp_path, reward, max_steps=1)
    with pytest.raises(RewardError, match=match):
        trainer.train()
    assert not (tmp_path / "run" / "checkpoints").exists() or not any(
        (tmp_path / "run" / "checkpoints").iterdir()
    )


@pytest.mark.parametrize(
    "values, match",
    [
        ([float("inf"), 0.0], "returned inf for prompt 'p0'"),
        ([0.0, -1e300], "returned -1e.300 for prompt 'p1'.*float32's range"),
        (["1.0", 0.0], "returned '1.0' for prompt 'p0'; rewards are floats"),
    ],
)
def test_infinite_or_textual_rewards_are_refused(values, match):
    """An infinite reward zeroed its group's advantages and logged reward=inf; a string was
    read with float() although a non-number is documented as an error."""
    with pytest.raises(RewardError, match=match):
        score_completions([lambda prompts, completions, **_: values], ["p0", "p1"], ["a", "b"], {})
    assert score_completions([lambda **_: [True, 2]], ["p0", "p1"], ["a", "b"], {}).tolist() == [
        [1.0], [2.0]
    ]  # fmt: skip


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(num_generations=1), "num_generations=1: a group needs at least 2"),
        (dict(num_generations=3), "multiple of num_generations=3"),
        (dict(loss_type="ppo"), "loss_type='ppo' is not one of"),
        (dict(scale_rewards="max"), "scale_rewards='max'"),
    ],
)
def test_bad_arguments_are_argument_errors_before_compiling(tmp_path, overrides, match):
    with pytest.raises(ArgumentError, match=match):
        grpo_args(tmp_path, **overrides)


def test_processes_must_each_generate_whole_groups(tmp_path):
    # 16 rows in 2 micro-batches of 8: 4 per process of 2 is one group of 4, not of 8.
    args = grpo_args(tmp_path, total_batch_size=16, gradient_accumulation_steps=2)
    check_process_groups(
        RunSettings.from_arguments(dataclasses.replace(args, num_generations=4)), 2
    )
    with pytest.raises(ArgumentError, match=r"8 rows / 2 processes = 4.*multiple of 16"):
        check_process_groups(
            RunSettings.from_arguments(dataclasses.replace(args, num_generations=8)), 2
        )
    with pytest.raises(ArgumentError, match=r"8 rows / 3 processes = 2.66667"):
        check_process_groups(
            RunSettings.from_arguments(dataclasses.replace(args, num_generations=2)), 3
        )


def test_builtin_rewards():
    assert last_number_matches(["q"] * 3, ["it is 7", "7 or 8", "none"], answer=[7, "7", 1]) == [
        1.0,
        0.0,
        0.0,
    ]
    reward = format_regex(r"\d+ </s>")
    assert reward(["q", "q"], ["12 </s>", "12 13"]) == [1.0, 0.0]


class Completions:
    """Each step's sampled completions (the trainer's last generated batch) and logs; stops
    the run after step `stop_after` (a kill: steps after the last save are lost)."""

    def __init__(self, stop_after: int | None = None):
        self.by_step: dict[int, list[str]] = {}
        self.logs: dict[int, dict[str, float]] = {}
        self.stop_after = stop_after

    def on_step_end(self, trainer, state, metrics, step):
        self.by_step[step] = list(trainer.last_completions)
        if step == self.stop_after:
            trainer.should_stop = True

    def on_log(self, trainer, logs, step):
        self.logs[step] = dict(logs)


def run(tokenizer, out, seen, trainer_class=GRPOTrainer, **overrides):
    import jax

    values = dict(max_steps=8, save_steps=2, num_iterations=2, beta=0.04)
    args = grpo_args(out, **{**values, **overrides})
    trainer = trainer_class(
        arguments=args,
        model=tiny_model(),
        reward_funcs=[big_first_number],
        dataset_train=prompts(),
        processing_class=tokenizer,
        callbacks=[seen],
    )
    output = trainer.train()
    return jax.tree.leaves(jax.device_get(output.state.params))


# What a round's updates log that is a function of its batch and the parameters (the
# times and throughputs are the machine's).
ROUND_LOGS = ("loss", "kl", "clip_ratio", "entropy", "reward", "reward_std",
              "rewards/big_first_number", "frac_reward_zero_std", "completions/mean_length",
              "completions/min_length", "completions/max_length", "completions/clipped_ratio")  # fmt: skip


def test_exact_resume_inside_a_round(tokenizer, tmp_path):
    """Rounds of 3 updates, saves every 2 steps: killed after step 4, inside the second round
    (steps 4-6), and resumed from that checkpoint, the run finishes the round on the saved
    batch: the same completions and logs from there on, bit-equal parameters at the end."""
    args = dict(num_iterations=3, max_steps=6, beta=0.0)
    whole, part, rest = Completions(), Completions(stop_after=4), Completions()
    full = run(tokenizer, tmp_path / "a", whole, **args)
    checkpoints = tmp_path / "a" / "run" / "checkpoints"
    # Inside a round the checkpoint keeps its batch; at a round's end it keeps none.
    assert (checkpoints / "4" / "extra").is_dir() and not (checkpoints / "6" / "extra").exists()
    run(tokenizer, tmp_path / "b", part, **args)
    resumed = run(tokenizer, tmp_path / "b", rest, **args)
    assert sorted(rest.by_step) == [5, 6]
    for step in rest.by_step:
        assert rest.by_step[step] == whole.by_step[step], step
        for key in ROUND_LOGS:
            assert rest.logs[step][key] == whole.logs[step][key], (step, key)
    assert rest.logs[5]["time/generation_s"] == 0.0  # the round was not sampled again
    for a, b in zip(full, resumed, strict=True):
        np.testing.assert_array_equal(a, b)


class WithoutRounds(GRPOTrainer):
    """Checkpoints as jaxtrain wrote them before they kept a round's batch."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.train_source.checkpoint_extra = lambda step: None


def test_a_checkpoint_without_the_round_says_the_resume_is_not_exact(tokenizer, tmp_path, caplog):
    """A checkpoint inside a round that holds no generated batch (an older jaxtrain's, here
    the final save at step 3 of rounds of 2 updates) still resumes: the round is sampled
    again, and the run says so."""
    import logging

    args = dict(num_iterations=2, save_steps=2, save_final=True, beta=0.0)
    run(tokenizer, tmp_path, Completions(), WithoutRounds, max_steps=3, **args)
    assert not (tmp_path / "run" / "checkpoints" / "3" / "extra").exists()
    with caplog.at_level(logging.WARNING, logger="jaxtrain"):
        run(tokenizer, tmp_path, Completions(), max_steps=4, **args)
    said = [r.getMessage() for r in caplog.records if "inside a round" in r.getMessage()]
    assert len(said) == 1 and "resumed at step 3" in said[0], said


@pytest.mark.parametrize("lora", [False, True])
def test_exact_resume_mid_run(tokenizer, tmp_path, lora):
    """Killed after step 5 (last save: step 4), resumed: the same completions from there on
    as the uninterrupted run, and bit-equal parameters at the end (num_iterations 2, KL)."""
    extra = dict(lora_rank=4, lora_alpha=8) if lora else {}
    whole, part, rest = Completions(), Completions(stop_after=5), Completions()
    full = run(tokenizer, tmp_path / "a", whole, **extra)
    run(tokenizer, tmp_path / "b", part, **extra)
    resumed = run(tokenizer, tmp_path / "b", rest, **extra)
    assert sorted(rest.by_step) == [5, 6, 7, 8]
    for step in rest.by_step:
        assert rest.by_step[step] == whole.by_step[step], step
    for a, b in zip(full, resumed, strict=True):
        np.testing.assert_array_equal(a, b)


def test_lora_reference_is_the_base_without_adapters(tokenizer, tmp_path):
    logs = Logs()
    args = grpo_args(tmp_path, max_steps=3, beta=0.04, lora_rank=4, lora_alpha=8)
    trainer = GRPOTrainer(
        arguments=args,
        model=tiny_model(),
        reward_funcs=[big_first_number],
        dataset_train=prompts(),
        processing_class=tokenizer,
        callbacks=[logs],
    )
    assert trainer.model.reference is None  # no second copy of the weights
    trainer.train()
    kls = [entry["kl"] for entry in logs.logs]
    assert kls[0] == 0.0  # B = 0 at the start: policy == base
    assert 0 < kls[-1] < 1.0  # the adapters moved the policy away from the base


def test_cli_task_grpo_with_a_reward_path_and_builtins(tokenizer, tmp_path, monkeypatch, capsys):
    import json

    import yaml

    from jaxtrain.cli import main

    tokenizer.save_pretrained(tmp_path / "tokenizer")
    rows = tmp_path / "prompts.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in prompts(8)))
    (tmp_path / "my_rewards.py").write_text(
        "def starts_big(prompts, completions, answer, **_):\n"
        "    return [float(c.split()[:1] > ['10']) for c in completions]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    config = {
        "task": "grpo",
        "output_dir": str(tmp_path / "run"),
        "model": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1),
        "data": {"source": "files", "train_files": str(rows),
                 "tokenizer": str(tmp_path / "tokenizer")},
        "max_steps": 2, "total_batch_size": 8, "num_generations": 4, "max_prompt_length": 8,
        "max_completion_length": 3, "warmup_steps": 0, "logging_steps": 1,
        "progress_bar": "none", "run_report": False, "save_final": False,
        "evaluation_strategy": "no", "report_to": "jsonl",
    }  # fmt: skip
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(config))
    args = [
        "train",
        str(path),
        "--reward",
        "my_rewards:starts_big,last_number_matches,format_regex",
    ]
    # Eval prompts from the shell too (once refused: "does not evaluate during training yet").
    evaluated = [
        "--data.eval_files",
        str(rows),
        "--evaluation_strategy",
        "steps",
        "--eval_steps",
        "2",
    ]
    assert main([*args, "--format_pattern", r"\d+.*", *evaluated]) == 0
    logs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    steps = [entry for entry in logs if "reward" in entry]
    assert len(steps) == 2
    assert [entry["step"] for entry in logs if "eval/reward" in entry] == [2]
    for name in ("starts_big", "last_number_matches", "format_regex('\\\\d+.*')"):
        assert f"rewards/{name}" in steps[-1], sorted(steps[-1])
    capsys.readouterr()
    assert main([*args, "--output_dir", str(tmp_path / "run2")]) == 2
    assert "format_regex reward needs a pattern" in capsys.readouterr().err


def test_eval_prompts_are_scored_every_eval_steps(tokenizer, tmp_path):
    """dataset_eval of prompts: k completions each, their rewards and pass@k, logged at every
    evaluation; the same numbers from evaluate() on the final state."""
    import json

    args = grpo_args(
        tmp_path, max_steps=4, eval_steps=2, eval_num_generations=3, eval_pass_threshold=1.0
    )
    trainer = GRPOTrainer(
        arguments=args,
        model=tiny_model(),
        reward_funcs=[big_first_number],
        dataset_train=prompts(),
        dataset_eval=prompts(5),
        processing_class=tokenizer,
    )
    output = trainer.train()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    evals = [r for r in records if "eval/pass@3" in r]
    assert [r["step"] for r in evals] == [2, 4]
    last = evals[-1]
    assert 0 <= last["eval/pass@3"] <= 1 and 0 <= last["eval/reward"] <= 1
    assert last["eval/rewards/big_first_number"] == last["eval/reward"]  # one function, weight 1
    # pass@k is at least the chance that one completion passes (the mean reward here).
    assert last["eval/pass@3"] >= last["eval/reward"] - 1e-9
    again = trainer.evaluate(output.state)  # a seed of its own: the same completions
    assert (
        again["eval/reward"] == last["eval/reward"] and again["eval/pass@3"] == last["eval/pass@3"]
    )


def test_several_decode_steps_a_call_sample_the_same_rounds(tokenizer, tmp_path):
    """rollout_decode_steps=4: the engine draws up to 4 tokens per completion in a call, and
    the run's completions, losses and parameters are those of single steps."""
    one, four = Completions(), Completions()
    settings = dict(max_steps=2, num_iterations=1, save_steps=None, max_completion_length=7)
    params_one = run(tokenizer, tmp_path / "one", one, **settings)
    params_four = run(tokenizer, tmp_path / "four", four, rollout_decode_steps=4, **settings)
    assert four.by_step == one.by_step
    assert [four.logs[s]["loss"] for s in (1, 2)] == [one.logs[s]["loss"] for s in (1, 2)]
    for a, b in zip(params_four, params_one):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ArgumentError, match="rollout_decode_steps=0 must be an integer >= 1"):
        grpo_args(tmp_path, rollout_decode_steps=0)


def test_chat_prompts_are_rendered_with_the_run_s_chat_template(tokenizer, tmp_path):
    """GRPO once ignored TrainingArguments.chat_template (a tokenizer without a template
    crashed in transformers with a traceback); the other tasks had used it. The run renders
    its prompts with it, saves it with its tokenizer, and leaves the caller's tokenizer alone."""
    import copy

    from jaxtrain.data.errors import DatasetError

    bare = copy.copy(tokenizer)
    bare.chat_template = None
    rows = [{"prompt": [{"role": "user", "content": r["prompt"]}]} for r in prompts(4)]
    with pytest.raises(DatasetError, match="no chat_template; set TrainingArguments.chat_"):
        GRPOTrainer(arguments=grpo_args(tmp_path), model=tiny_model(), dataset_train=rows,
                    reward_funcs=[big_first_number], processing_class=bare)  # fmt: skip
    template = "{% for m in messages %}{{ m['content'] }} = {% endfor %}"
    trainer = GRPOTrainer(arguments=grpo_args(tmp_path, chat_template=template),
                          model=tiny_model(), dataset_train=rows, reward_funcs=[big_first_number],
                          processing_class=bare)  # fmt: skip
    expected = bare(f"{prompts(4)[1]['prompt']} = ", add_special_tokens=False)["input_ids"]
    assert trainer.train_source.prompts.ids[1].tolist() == expected[-8:]
    assert bare.chat_template is None and trainer.processing_class.chat_template == template
