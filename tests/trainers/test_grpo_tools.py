"""GRPO with tools on the engine: a tiny model taught here to call a calculator, rollouts
that go on after the tools' answers, the answers' tokens out of the loss, environments per
rollout, failures answered (never raised), and an exact resume inside a round."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tool_chat_fixtures import add, broken, tool_caller, tool_tokenizer

from jaxtrain.data.collate import IGNORE_INDEX
from jaxtrain.data.errors import DatasetError
from jaxtrain.errors import ArgumentError
from jaxtrain.serving.tool_chat import TOOL_CHAT_TEMPLATE, parse_turn, response_template
from jaxtrain.trainers import GRPOArguments, GRPOTrainer
from jaxtrain.trainers.grpo_loss import grpo_loss
from jaxtrain.trainers.grpo_prompts import chat_ids
from jaxtrain.trainers.rewards import load_callable
from jaxtrain.trainers.tool_rollouts import Episode, play_tool_turns
from jaxtrain.trainers.tools import Toolbox, ToolCalls

# jaxtrain's ChatML template with tools (<tool_call> JSON): the tokenizer has no
# response_template, so jaxtrain reads the calls with its own for that format.
TEMPLATE = TOOL_CHAT_TEMPLATE
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 5}}\n</tool_call><|im_end|>'


def rows(n: int = 4) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"add 2 and 5 ({i})"}], "want": 7}
            for i in range(n)]  # fmt: skip


@pytest.fixture(scope="module")
def tok():
    texts = [CALL, "<tool_response>\n7\n</tool_response>", "add 2 and 5 (0) Reach 7."]
    shown = tool_tokenizer(TEMPLATE, [])  # to render the prompts the BPE then compresses
    texts += [shown.apply_chat_template(r["prompt"], tools=[add, broken], tokenize=False)
              for r in rows(2)]  # fmt: skip
    return tool_tokenizer(TEMPLATE, texts + ["{'error': 'the broken tool broke'}"])


@pytest.fixture(scope="module")
def caller(tok):
    """Parameters of a tiny Llama that answers every prompt with CALL (with and without the
    Counter environment's observation)."""
    observed = [[{"role": "user", "content": m["content"] + " Reach 7."}]
                for r in rows(8) for m in r["prompt"]]  # fmt: skip
    chats = [r["prompt"] for r in rows(8)] + observed
    return nnx.state(tool_caller(tok, chats, [add], CALL))


def fresh_caller(tok, caller):
    model = tool_caller(tok, [], [add], CALL, steps=0)  # the architecture, then its weights
    nnx.update(model, jax.tree.map(jnp.copy, caller))
    return model


class Logs:
    def __init__(self, stop_after=None):
        self.logs, self.completions, self.stop_after = {}, {}, stop_after

    def on_step_end(self, trainer, state, metrics, step):
        self.completions[step] = list(trainer.last_completions)
        if step == self.stop_after:
            trainer.should_stop = True

    def on_log(self, trainer, logs, step):
        self.logs[step] = dict(logs)


def says_seven(prompts, completions, completion_messages, **_):
    """1 when a tool answered 7 in the conversation (TRL's completions, as messages)."""
    return [float(any(m["role"] == "tool" and m["content"] == "7" for m in conversation))
            for conversation in completion_messages]  # fmt: skip


def arguments(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path / "run"), total_batch_size=8, num_generations=2,
        max_prompt_length=192, max_completion_length=64, max_steps=2, learning_rate=1e-3,
        warmup_steps=0, logging_steps=1, progress_bar="none", save_final=False,
        run_report=False, temperature=0.7, max_tool_calling_iterations=2, seed=3,
        eval_num_generations=2, eval_steps=100, rollout_warm_up=False,
    )  # fmt: skip
    return GRPOArguments(**{**values, **overrides})


def test_rollouts_call_the_tool_and_its_answer_is_out_of_the_loss(tok, caller, tmp_path):
    logs = Logs()
    trainer = GRPOTrainer(
        arguments=arguments(tmp_path),
        model=fresh_caller(tok, caller),
        reward_funcs=[says_seven],
        dataset_train=rows(),
        processing_class=tok,
        tools=[add],  # as the model was taught: the prompt shows this one
        callbacks=[logs],
        dataset_eval=rows(2),
    )
    output = trainer.train()
    first = logs.logs[1]
    assert first["tools/call_frequency"] >= 1 and first["tools/failure_frequency"] == 0
    assert first["rewards/says_seven"] == 1.0  # every rollout got the calculator's answer
    assert 0 < first["tools/environment_token_share"] < 1
    source = trainer.train_source
    batch = source._round.host
    ids, labels = batch["input_ids"].reshape(8, -1), batch["labels"].reshape(8, -1)
    for i, episode in source._episodes.items():
        p, n = len(episode.prompt), len(episode.tokens)
        # The tokens trained on are the tokens sampled and the tools' answers, as they were.
        assert ids[i, p : p + n].tolist() == episode.tokens
        assert (labels[i, p : p + n] != IGNORE_INDEX).tolist() == episode.from_model
        assert not all(episode.from_model)  # a tool answered in every rollout
        assert episode.messages[1] == {"role": "tool", "name": "add", "content": "7"}
    # No gradient reaches the log-prob of a token a tool wrote.
    mask = labels[:, 1:] != IGNORE_INDEX
    logps = jnp.asarray(np.random.default_rng(0).normal(-2, 0.5, mask.shape), jnp.float32)
    advantages = jnp.asarray([1.0, -1.0] * 4)

    def loss(logps):
        return grpo_loss(logps, None, None, advantages, jnp.asarray(mask), loss_type="dapo",
                         beta=0.0, epsilon=0.2, epsilon_high=0.2, max_completion_length=64)[0]  # fmt: skip

    grad = np.asarray(jax.grad(loss)(logps))
    assert (grad[~mask] == 0).all() and (grad[mask] != 0).all()
    # The evaluation runs the same tool loop: calls per episode, failures, rewards.
    scores = trainer.evaluate(output.state)
    assert scores["eval/tools/calls_per_episode"] >= 1 and scores["eval/tools/failures"] == 0
    assert scores["eval/rewards/says_seven"] == 1.0


class Counter:
    """An environment: its tool counts, its reward reads the count, reset says the goal."""

    def __init__(self):
        self.count, self.goal = 0, None

    def reset(self, want, **_):
        self.count, self.goal = 0, want
        return f" Reach {want}."

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.count += 1
        return a + b

    def get_reward(self) -> float:
        return float(self.count)


def test_an_environment_per_rollout_whose_reward_reads_its_state(tok, caller, tmp_path):
    logs = Logs()
    trainer = GRPOTrainer(
        arguments=arguments(tmp_path, max_steps=1),
        model=fresh_caller(tok, caller),
        dataset_train=rows(),
        processing_class=tok,
        environment_factory=Counter,
        callbacks=[logs],
    )
    trainer.train()
    episodes = trainer.train_source._episodes
    environments = {id(e.toolbox.environment) for e in episodes.values()}
    assert len(environments) == 8  # one per rollout
    for episode in episodes.values():
        assert episode.toolbox.environment.count == episode.calls - episode.failures
        assert tok.decode(episode.prompt).count("Reach 7.") == 1  # the observation
    made = [e.calls - e.failures for e in episodes.values()]
    assert logs.logs[1]["rewards/Counter"] == np.mean(made)
    assert logs.logs[1]["tools/call_frequency"] >= 1


class Multiplier:
    """Another environment, without a reward of its own."""

    def reset(self, **row):
        return None

    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: The first factor.
            b: The second factor.
        """
        return a * b


def test_environments_chosen_per_row_show_their_own_tools(tok, caller, tmp_path):
    """TRL's dict environment_factory: each row's `environment` column picks one."""
    picked = [{**row, "environment": ["count", "mul"][i % 2]} for i, row in enumerate(rows())]
    trainer = GRPOTrainer(
        arguments=arguments(tmp_path), model=fresh_caller(tok, caller), dataset_train=picked,
        processing_class=tok, environment_factory={"count": Counter, "mul": Multiplier},
    )  # fmt: skip
    prompts = trainer.train_source.prompts
    for i in range(len(picked)):
        text = tok.decode(prompts.ids[i])
        assert ('"multiply"' in text) == (i % 2 == 1) and ('"add"' in text) == (i % 2 == 0)
    boxes, seen = trainer.train_source.tool_calls.toolboxes(picked)
    assert [type(b.environment).__name__ for b in boxes] == ["Counter", "Multiplier"] * 2
    assert seen == [" Reach 7.", None] * 2  # reset got the row without `environment`
    assert [f.__name__ for f in trainer.reward_funcs] == ["Counter"]
    with pytest.raises(ArgumentError, match="row 1 has environment='div'"):
        GRPOTrainer(
            arguments=arguments(tmp_path), model=fresh_caller(tok, caller),
            dataset_train=[picked[0], {**picked[1], "environment": "div"}] * 2,
            processing_class=tok, environment_factory={"count": Counter, "mul": Multiplier},
        )  # fmt: skip


def test_resume_inside_a_multi_turn_round_is_exact(tok, caller, tmp_path):
    args = dict(max_steps=4, num_iterations=2, save_steps=1)
    whole, part, rest = Logs(), Logs(stop_after=3), Logs()

    def run(out, seen):
        trainer = GRPOTrainer(
            arguments=arguments(out, **args),
            model=fresh_caller(tok, caller),
            reward_funcs=[says_seven],
            dataset_train=rows(),
            processing_class=tok,
            tools=[add],
            callbacks=[seen],
        )
        return jax.tree.leaves(jax.device_get(trainer.train().state.params))

    full = run(tmp_path / "a", whole)
    run(tmp_path / "b", part)
    resumed = run(tmp_path / "b", rest)
    assert sorted(rest.completions) == [4]
    assert rest.completions[4] == whole.completions[4]
    assert rest.logs[4]["loss"] == whole.logs[4]["loss"]
    for a, b in zip(full, resumed, strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_command_line_names_tools_and_the_environment(tok, caller, tmp_path):
    """--tools module:function,... and --environment module:Class (found on sys.path)."""
    args = arguments(tmp_path, tools="tool_chat_fixtures:broken, tool_chat_fixtures:add",
                     environment="test_grpo_tools:Counter")  # fmt: skip
    assert args.tools == ["tool_chat_fixtures:broken", "tool_chat_fixtures:add"]
    with pytest.raises(ArgumentError, match="two tools are named .add.*Counter"):
        GRPOTrainer(arguments=args, model=fresh_caller(tok, caller), dataset_train=rows(),
                    processing_class=tok)  # fmt: skip
    args.tools = args.tools[:1]
    trainer = GRPOTrainer(arguments=args, model=fresh_caller(tok, caller), dataset_train=rows(),
                          processing_class=tok)  # fmt: skip
    shown = trainer.train_source.tool_calls.schema_tools
    assert [t.__name__ for t in shown] == ["broken", "add"]  # Counter.add after the functions
    assert [f.__name__ for f in trainer.reward_funcs] == ["Counter"]
    with pytest.raises(ArgumentError, match="tool 'tool_chat_fixtures:nope' cannot be loaded"):
        GRPOTrainer(arguments=arguments(tmp_path, tools=["tool_chat_fixtures:nope"]),
                    model=fresh_caller(tok, caller), dataset_train=rows(), processing_class=tok,
                    reward_funcs=[says_seven])  # fmt: skip


def test_a_broken_module_or_an_environment_needing_arguments_is_one_error(tmp_path, monkeypatch):
    """A syntax error in a --reward/--tools module, a module failing as it imports, and an
    environment class whose __init__ needs arguments were tracebacks (exit 1)."""
    (tmp_path / "typo_rewards.py").write_text("def bad(:\n    return 1\n")
    (tmp_path / "failing_rewards.py").write_text("import os\nvalue = undefined_name\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ArgumentError, match=r"reward 'typo_rewards:bad' cannot be loaded: "
                       r".*typo_rewards\.py line 1: invalid syntax"):  # fmt: skip
        load_callable("typo_rewards:bad", "reward")
    with pytest.raises(ArgumentError, match="importing failing_rewards raised NameError"):
        load_callable("failing_rewards:value", "tool")

    class NeedsArguments:
        def __init__(self, size):
            self.size = size

        def reset(self, **row):
            return None

    for factory in (NeedsArguments, add):
        with pytest.raises(ArgumentError, match="cannot be called without arguments"):
            ToolCalls([], factory)


# ---------------------------------------------------------------- failures are answers
def test_every_failing_call_is_answered_and_counted(tok):
    import time

    def slow(seconds: float) -> str:
        """Sleeps.

        Args:
            seconds: How long.
        """
        time.sleep(seconds)
        return "done"

    class Unprintable:
        def __str__(self):
            raise RuntimeError("cannot print me")

    def leaves(how: str):
        """Ends the process, as code a tool runs may (exit(), argparse); or cannot be read.

        Args:
            how: exit, exit3, interrupt or unprintable.
        """
        if how == "unprintable":
            return Unprintable()
        if how == "interrupt":
            raise KeyboardInterrupt
        sys.exit(3 if how == "exit3" else 0)

    box = Toolbox([add, broken, slow, leaves])
    call = lambda name, **arguments: {"type": "function",  # noqa: E731
                                      "function": {"name": name, "arguments": arguments}}  # fmt: skip
    assert box.call(call("add", a=1, b=2), 5.0) == ("add", "3", False)
    # A tool that exits, interrupts or returns what cannot be printed once ended the run
    # (exit code 0 or 3 and no checkpoint, a traceback): answered like any failure now.
    for made, said in [
        (call("nope"), "{'error': 'Tool nope not found.'}"),
        (call("add", a=1, c=2), "unexpected keyword argument 'c'"),
        (call("broken", text="x"), "{'error': 'the broken tool broke'}"),
        (call("slow", seconds=5), "slow did not answer within 0.2 s"),
        (call("leaves", how="exit"), "the tool raised SystemExit(0)"),
        (call("leaves", how="exit3"), "the tool raised SystemExit(3)"),
        (call("leaves", how="interrupt"), "the tool raised KeyboardInterrupt()"),
        (call("leaves", how="unprintable"), "cannot print me"),
    ]:
        start = time.perf_counter()
        name, answer, failed = box.call(made, 0.2)
        assert failed and said in answer, answer
        assert time.perf_counter() - start < 2
    for how in ("exit", "unprintable"):  # in the caller's thread (no timeout) too
        assert box.call(call("leaves", how=how), None)[2]


def test_a_malformed_call_is_answered_and_the_rollout_goes_on(tok):
    template = response_template(tok)
    prompt = chat_ids(tok, rows(1)[0]["prompt"], [add])
    bad = tok('<tool_call>\n{"name": "add", "arguments": {"a": 2\n</tool_call><|im_end|>',
              add_special_tokens=False)["input_ids"]  # fmt: skip
    turn = parse_turn(tok, template, bad, prompt, [add])
    assert turn.malformed and not turn.calls
    plain = tok("It is 7.<|im_end|>", add_special_tokens=False)["input_ids"]
    assert parse_turn(tok, template, plain, prompt, [add]).message["content"] == "It is 7."
    episode = Episode(list(prompt), Toolbox([add]), list(bad), [0.0] * len(bad))
    asked = []

    def generate(asks):
        asked.extend(asks)
        return [(plain, [0.0] * len(plain)) for _ in asks]

    play_tool_turns([episode], generate, tok, template, max_completion_length=200,
                    max_iterations=3, timeout=1.0, seed=lambda i, r: 0)  # fmt: skip
    assert episode.calls == episode.failures == 1 and len(asked) == 1
    assert "malformed tool call" in episode.messages[1]["content"]
    assert episode.tokens[-len(plain) :] == plain and episode.from_model[-1]


def test_tools_need_a_template_that_shows_them_and_chat_prompts(tmp_path, tok, caller, tokenizer):
    """`tokenizer`: the task tests' word-level one, whose template has no tool turns."""
    with pytest.raises(ArgumentError, match="drops tool calls or tool answers"):
        GRPOTrainer(arguments=arguments(tmp_path), model=fresh_caller(tok, caller),
                    reward_funcs=[says_seven], dataset_train=rows(), processing_class=tokenizer,
                    tools=[add])  # fmt: skip
    with pytest.raises(DatasetError, match="needs chat prompts"):
        GRPOTrainer(arguments=arguments(tmp_path), model=fresh_caller(tok, caller),
                    reward_funcs=[says_seven], dataset_train=[{"prompt": "add 2 and 5"}] * 4,
                    processing_class=tok, tools=[add])  # fmt: skip


def test_a_tools_run_s_sample_is_prompted_with_its_tools(tok, caller, tmp_path, capsys):
    """The end-of-run sample (and `jaxtrain sample`) rendered a tools run's chat prompt
    without the tools its rollouts showed: the model was asked what it never saw."""
    from jaxtrain.cli.commands import print_sample

    args = arguments(tmp_path, tools=["tool_chat_fixtures:add"])
    print_sample(fresh_caller(tok, caller), tok, {"max_new_tokens": 2}, rows(1), args)
    shown = tok.apply_chat_template(
        rows(1)[0]["prompt"], tools=[add], add_generation_prompt=True, tokenize=False
    )
    printed = capsys.readouterr().out
    assert '"name": "add"' in shown and shown in printed, printed
