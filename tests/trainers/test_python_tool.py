"""The interpreter environment: the model's code runs in a limited subprocess; a runaway loop
and a memory bomb are stopped and answered, and the rollout goes on."""

from __future__ import annotations

import time

from tool_chat_fixtures import tool_tokenizer

from jaxtrain.serving.tool_chat import TOOL_CHAT_TEMPLATE, response_template
from jaxtrain.trainers.python_tool import PythonInterpreter
from jaxtrain.trainers.tool_rollouts import Episode, play_tool_turns
from jaxtrain.trainers.tools import ToolCalls


def test_code_runs_and_what_it_prints_is_the_answer():
    python = PythonInterpreter(seconds=5)
    assert python.run_python("print(6 * 7)") == "42\n"
    said = python.run_python("import os; print(os.getcwd())")
    assert "jaxtrain-python-" in said  # a fresh temporary directory
    said = python.run_python("1 / 0")
    assert "ZeroDivisionError" in said and python.errors == 1


def test_a_runaway_loop_and_a_memory_bomb_are_stopped():
    python = PythonInterpreter(seconds=1, memory_mb=200)
    start = time.perf_counter()
    said = python.run_python("while True:\n    pass")
    assert "stopped" in said and time.perf_counter() - start < 5, said
    said = python.run_python("x = bytearray(2 * 10**9)\nprint('allocated')")
    assert "MemoryError" in said and "allocated" not in said, said
    assert python.calls == 2 and python.errors == 2


def test_a_rollout_goes_on_after_its_code_is_stopped():
    texts = ['<tool_call>\n{"name": "run_python", "arguments": {"code": "while True: pass"}}'
             "\n</tool_call>", "It ran too long."]  # fmt: skip
    tok = tool_tokenizer(TOOL_CHAT_TEMPLATE, texts)
    calls = ToolCalls(None, lambda: PythonInterpreter(seconds=1))
    [box], _ = calls.toolboxes([{"prompt": []}])
    first = tok(texts[0] + tok.eos_token, add_special_tokens=False)["input_ids"]
    last = tok(texts[1] + tok.eos_token, add_special_tokens=False)["input_ids"]
    prompt = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    episode = Episode(prompt, box, list(first), [0.0] * len(first))
    play_tool_turns(
        [episode], lambda asks: [(last, [0.0] * len(last)) for _ in asks], tok,
        response_template(tok), max_completion_length=400, max_iterations=2, timeout=10.0,
        seed=lambda i, r: 0,
    )  # fmt: skip
    assert episode.messages[1]["name"] == "run_python"
    assert episode.messages[1]["content"].startswith("stopped: the code ran past 1 s")
    assert episode.messages[-1]["content"] == "It ran too long."
    assert episode.calls == 1 and episode.failures == 0  # the tool answered: not a failure
    assert box.environment.errors == 1
