"""The tools of a GRPO rollout: plain functions and environments, called as the model asks.

A tool is a Python function with type hints and a docstring (its JSON schema, which the chat
template shows the model, is transformers' `get_json_schema` of it). An environment is a class
(`environment_factory`) with a `reset(**row)` method: every rollout gets an instance, reset
with its dataset row, whose public methods are that rollout's tools (and whose `get_reward()`,
if it has one, is a reward function); reward functions receive the instances as
`environments`. These are TRL's shapes (GRPOTrainer's tools and environment_factory).

A call that fails is an answer, not a crash: an unknown tool, arguments the function does not
take, an exception or a call running past `timeout` seconds give the model
`{"error": "..."}` as the tool's answer, and are counted. A timed-out call's thread is left
to finish on its own (Python cannot stop a thread): a tool that may hang or run user code
should run it in a subprocess with limits of its own (docs/tasks.md's interpreter example).
"""

from __future__ import annotations

import concurrent.futures
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from jaxtrain.errors import ArgumentError

__all__ = ["Toolbox", "ToolCalls", "environment_reward"]

NOT_TOOLS = ("reset", "get_reward")


class Toolbox:
    """One rollout's tools: the plain `tools` and the public methods of its `environment`."""

    def __init__(self, tools: Sequence[Callable], environment: Any = None):
        methods = []
        if environment is not None:
            methods = [
                getattr(environment, name)
                for name, _ in inspect.getmembers(type(environment), inspect.isfunction)
                if not name.startswith("_") and name not in NOT_TOOLS
            ]
        self.tools = list(tools) + methods
        self.by_name = {tool.__name__: tool for tool in self.tools}
        self.environment = environment

    def call(self, call: dict[str, Any], timeout: float | None) -> tuple[str, str, bool]:
        """(tool name, its answer as the conversation shows it, whether the call failed)."""
        if call.get("type", "function") != "function":
            name = call.get("name", "unknown")
            return name, str({"error": f"Unsupported tool call type: {call['type']}"}), True
        function = call.get("function", call)
        name, arguments = function["name"], function.get("arguments") or {}
        try:
            tool = self.by_name.get(name)
            if tool is None:
                raise ValueError(f"Tool {name} not found.")
            if not isinstance(arguments, dict):
                raise TypeError(f"{name}() arguments must be an object, got {arguments!r}")
            result = _run(tool, arguments, timeout)
        except Exception as exc:  # the model's mistake or the tool's: answered, counted
            return name, str({"error": str(exc)}), True
        return name, result if isinstance(result, str) else str(result), False


def _run(tool: Callable, arguments: dict[str, Any], timeout: float | None) -> Any:
    if timeout is None:
        return tool(**arguments)
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxtrain-tool")
    try:
        return pool.submit(tool, **arguments).result(timeout=timeout)
    except concurrent.futures.TimeoutError:
        raise TimeoutError(f"{tool.__name__} did not answer within {timeout:g} s") from None
    finally:
        pool.shutdown(wait=False)


class ToolCalls:
    """The tools of every rollout (GRPOTrainer's `tools` and `environment_factory`) and the
    environments of the current round, made and reset per rollout."""

    def __init__(self, tools: Sequence[Callable] | None, environment_factory: Callable | None):
        self.tools = list(tools or [])
        for tool in self.tools:
            if not callable(tool) or not getattr(tool, "__name__", None):
                raise ArgumentError(f"tool {tool!r} is not a named function")
        if isinstance(environment_factory, dict):
            raise ArgumentError(
                "environment_factory takes one factory (a class or function returning an "
                "environment); several environments chosen per row are not supported yet."
            )
        self.factory = environment_factory
        self.reward: Callable | None = None
        self.schema_tools = self.tools  # what the chat template shows: functions + methods
        if environment_factory is not None:
            probe = environment_factory()
            if not callable(getattr(probe, "reset", None)):
                raise ArgumentError(
                    f"environment_factory made a {type(probe).__name__}, which has no reset() "
                    "method; an environment needs reset(**row) (it may return an observation "
                    "appended to the prompt)."
                )
            self.schema_tools = Toolbox(self.tools, probe).tools
            if callable(getattr(probe, "get_reward", None)):
                self.reward = environment_reward(type(probe))
            self._pool = [probe]  # instances are reused round after round, reset each time
        if not self.schema_tools:
            raise ArgumentError("tools: give at least one tool (a function or an environment)")
        names = [tool.__name__ for tool in self.schema_tools]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            where = f" and {type(probe).__name__}'s methods" if environment_factory else ""
            raise ArgumentError(
                f"two tools are named {twice[0]!r} (among the functions in tools{where}): the "
                "model calls tools by name; rename one"
            )

    def toolboxes(self, rows: list[dict[str, Any]]) -> tuple[list[Toolbox], list[str | None]]:
        """A toolbox per rollout of `rows` (their dataset rows) and what each environment's
        reset returned (an observation for the prompt, or None)."""
        if self.factory is None:
            box = Toolbox(self.tools)
            return [box] * len(rows), [None] * len(rows)
        while len(self._pool) < len(rows):
            self._pool.append(self.factory())
        boxes, observations = [], []
        for environment, row in zip(self._pool, rows):
            observation = environment.reset(**row)
            if observation is not None and not isinstance(observation, str):
                raise ArgumentError(
                    f"{type(environment).__name__}.reset returned {type(observation).__name__}; "
                    "return a string (appended to the prompt) or None"
                )
            boxes.append(Toolbox(self.tools, environment))
            observations.append(observation)
        return boxes, observations


def environment_reward(cls: type) -> Callable:
    """A reward function that asks each rollout's environment (of class `cls`) for its
    reward, named after the class."""

    def reward(prompts: Any, completions: Any, environments: list[Any], **_: Any) -> list:
        return [e.get_reward() if type(e) is cls else None for e in environments]

    reward.__name__ = cls.__name__
    return reward
