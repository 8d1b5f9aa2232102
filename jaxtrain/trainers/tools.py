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

__all__ = ["Toolbox", "ToolCalls", "environment_reward", "load_tools", "shown_tools"]

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
            answer = result if isinstance(result, str) else str(result)
        except (Exception, SystemExit) as exc:  # the model's mistake or the tool's: answered
            return name, str({"error": _describe(exc)}), True
        return name, answer, False


def _describe(exc: BaseException) -> str:
    """What the model reads of a tool's failure; exit() inside a tool is one too."""
    if isinstance(exc, SystemExit | KeyboardInterrupt):
        return f"the tool raised {type(exc).__name__}({exc})"
    return str(exc)


def _check_no_arguments(factory: Any) -> None:
    """ArgumentError unless `factory` (an environment's class) can be called with none: one
    environment is made per rollout, from nothing."""
    if not callable(factory):
        raise ArgumentError(f"environment_factory {factory!r} is not a class or function")
    try:
        inspect.signature(factory).bind()
    except TypeError as err:
        name = getattr(factory, "__name__", repr(factory))
        raise ArgumentError(
            f"environment_factory {name} cannot be called without arguments ({err}): pass a "
            "class (or function) that makes an environment from nothing; its reset(**row) "
            "receives each rollout's row."
        ) from None
    except ValueError:  # no signature to read (a builtin): calling it will tell
        return


def _run(tool: Callable, arguments: dict[str, Any], timeout: float | None) -> Any:
    if timeout is None:
        return tool(**arguments)
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxtrain-tool")
    try:
        return pool.submit(tool, **arguments).result(timeout=timeout)
    except concurrent.futures.TimeoutError:
        raise TimeoutError(f"{tool.__name__} did not answer within {timeout:g} s") from None
    except KeyboardInterrupt as exc:  # raised in the tool's own thread: the tool's, not a ^C
        raise RuntimeError(_describe(exc)) from None
    finally:
        pool.shutdown(wait=False)


class ToolCalls:
    """The tools of every rollout (GRPOTrainer's `tools` and `environment_factory`) and the
    environments of the current round, made and reset per rollout. `environment_factory` is
    one factory, or several by name (`{name: factory}`, TRL's shape): each row's `environment`
    column names its own, and its prompt shows that environment's tools only."""

    def __init__(self, tools: Sequence[Callable] | None, environment_factory: Any):
        self.tools = list(tools or [])
        for tool in self.tools:
            if not callable(tool) or not getattr(tool, "__name__", None):
                raise ArgumentError(f"tool {tool!r} is not a named function")
        self.by_row = isinstance(environment_factory, dict)
        factories = environment_factory if self.by_row else {None: environment_factory}
        if self.by_row and not factories:
            raise ArgumentError("environment_factory is an empty dict; name one environment")
        self.factory = environment_factory
        self.factories = {k: f for k, f in factories.items() if f is not None}
        self.rewards: list[Callable] = []
        self._pools: dict[Any, list[Any]] = {}  # instances reused round after round
        self._shown: dict[Any, list[Callable]] = {None: self.tools}
        for name, factory in self.factories.items():
            _check_no_arguments(factory)
            probe = factory()
            if not callable(getattr(probe, "reset", None)):
                raise ArgumentError(
                    f"environment_factory made a {type(probe).__name__}, which has no reset() "
                    "method; an environment needs reset(**row) (it may return an observation "
                    "appended to the prompt)."
                )
            self._shown[name] = Toolbox(self.tools, probe).tools
            _check_names(self._shown[name], type(probe).__name__)
            has_reward = callable(getattr(probe, "get_reward", None))
            if has_reward and type(probe) not in [r.environment for r in self.rewards]:
                self.rewards.append(environment_reward(type(probe)))
            self._pools[name] = [probe]
        # Every tool a prompt may show (the template check, the warm-up's prompt lengths).
        self.schema_tools = list({id(t): t for v in self._shown.values() for t in v}.values())
        if not self.schema_tools:
            raise ArgumentError("tools: give at least one tool (a function or an environment)")
        _check_names(self.tools, None)

    def environment_of(self, row: dict[str, Any], index: int | None = None) -> Any:
        """The name of `row`'s environment (None with one factory or none)."""
        if not self.by_row:
            return None
        name = row.get("environment")
        if name not in self.factories:
            where = f"row {index}" if index is not None else "a row"
            raise ArgumentError(
                f"{where} has environment={name!r}; environment_factory names "
                f"{sorted(self.factories)}: give each row an `environment` column among them"
            )
        return name

    def shown(self, row: dict[str, Any], index: int | None = None) -> list[Callable]:
        """The tools `row`'s prompt shows the model."""
        return self._shown[self.environment_of(row, index) if self.factories else None]

    def toolboxes(self, rows: list[dict[str, Any]]) -> tuple[list[Toolbox], list[str | None]]:
        """A toolbox per rollout of `rows` (their dataset rows) and what each environment's
        reset returned (an observation for the prompt, or None)."""
        if not self.factories:
            box = Toolbox(self.tools)
            return [box] * len(rows), [None] * len(rows)
        taken: dict[Any, int] = {}
        boxes, observations = [], []
        for row in rows:
            name = self.environment_of(row)
            pool, k = self._pools[name], taken.get(name, 0)
            if k == len(pool):
                pool.append(self.factories[name]())
            environment, taken[name] = pool[k], k + 1
            arguments = {
                key: v for key, v in row.items() if not (self.by_row and key == "environment")
            }
            observation = environment.reset(**arguments)
            if observation is not None and not isinstance(observation, str):
                raise ArgumentError(
                    f"{type(environment).__name__}.reset returned {type(observation).__name__}; "
                    "return a string (appended to the prompt) or None"
                )
            boxes.append(Toolbox(self.tools, environment))
            observations.append(observation)
        return boxes, observations


def _check_names(tools: list[Callable], environment: str | None) -> None:
    names = [tool.__name__ for tool in tools]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        where = f" and {environment}'s methods" if environment else ""
        raise ArgumentError(
            f"two tools are named {twice[0]!r} (among the functions in tools{where}): the "
            "model calls tools by name; rename one"
        )


def environment_reward(cls: type) -> Callable:
    """A reward function that asks each rollout's environment (of class `cls`) for its
    reward, named after the class."""

    def reward(prompts: Any, completions: Any, environments: list[Any], **_: Any) -> list:
        return [e.get_reward() if type(e) is cls else None for e in environments]

    reward.__name__ = cls.__name__
    reward.environment = cls  # type: ignore[attr-defined]
    return reward


def load_tools(specs: Sequence[str] | None, environment: str | None) -> tuple[list | None, Any]:
    """(tools, environment factory) of a run's `tools` / `environment` settings, each a
    module:function path (None where a setting is not given)."""
    from jaxtrain.trainers.rewards import load_callable

    tools = [load_callable(spec, "tool") for spec in specs] if specs else None
    return tools, load_callable(environment, "environment") if environment else None


def shown_tools(
    specs: Sequence[str] | None, environment: str | None
) -> Callable[[dict[str, Any]], list[Callable]] | None:
    """What a prompt row of a run with these `tools` / `environment` settings shows the model
    (its chat template writes the tools' schemas): `shown(row)`, or None for a run without
    tools. A sample of a tools run's model is prompted as its rollouts were."""
    tools, factory = load_tools(specs, environment)
    if not tools and factory is None:
        return None
    return ToolCalls(tools, factory).shown
