"""Config values: reading a YAML/JSON config file, and turning a value (often a CLI string)
into a dataclass field's annotated type, with an error naming the field when it cannot."""

from __future__ import annotations

import json
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from jaxtrain.errors import ArgumentError


def read_config_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ArgumentError(f"Config file {path} does not exist. Check the path.")
    text = path.read_text()
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except json.JSONDecodeError as err:
        raise ArgumentError(
            f"Config file {path}, line {err.lineno}, column {err.colno}: not valid JSON "
            f"({err.msg})."
        ) from None
    except yaml.YAMLError as err:
        raise ArgumentError(yaml_error_line(path, text, err)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ArgumentError(f"Config file {path} must hold a mapping of field: value at top level.")
    return data


def yaml_error_line(path: Path, text: str, err: yaml.YAMLError) -> str:
    """One line naming the file, the line and what is wrong (YAML's own is several lines)."""
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    where = f"Config file {path}"
    if mark is not None:
        where += f", line {mark.line + 1}, column {mark.column + 1}"
        line = text.splitlines()[mark.line] if mark.line < len(text.splitlines()) else ""
        if "\t" in line or "\t" in (getattr(err, "problem", "") or ""):
            return f"{where}: a tab character; YAML indents with spaces only. Replace it."
    problem = " ".join(str(getattr(err, "problem", None) or err).split())
    return f"{where}: not valid YAML ({problem})."


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def coerce_value(annotation: Any, value: Any, *, field: str, source: str = "arguments") -> Any:
    """Convert `value` (often a CLI string) to the field's annotated type, or explain why not."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        is_none = value is None or (isinstance(value, str) and value.lower() in ("none", "null"))
        if is_none and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return coerce_value(option, value, field=field, source=source)
            except ArgumentError as err:
                errors.append(str(err))
        raise ArgumentError(errors[0] if errors else f"{field}: cannot parse {value!r}")
    if origin is Literal:
        return value
    if annotation is list or origin is list:
        return _coerce_list(annotation, value, field=field, source=source)
    if (annotation is dict or origin is dict) and isinstance(value, str):
        parsed = yaml.safe_load(value)  # e.g. --model.rope_scaling '{rope_type: llama3, ...}'
        if not isinstance(parsed, dict):
            raise ArgumentError(f"{field} in {source} must be a mapping, got {value!r}.")
        return parsed
    bad = ArgumentError(
        f"{field} in {source} must be {getattr(annotation, '__name__', annotation)}, got {value!r}."
    )
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise bad
    if annotation in (int, float):
        return _number(annotation, value, bad)
    if annotation is str:
        if isinstance(value, str):
            return value
        raise bad
    return value


def _number(kind: type, value: Any, bad: ArgumentError) -> int | float:
    """An int or float from a number or a numeric string; never from a bool, and an int
    only from a whole float."""
    if isinstance(value, bool):
        raise bad
    if isinstance(value, str):
        try:
            return kind(value)
        except ValueError:
            raise bad from None
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, int) or (kind is float and isinstance(value, float)):
        return kind(value)
    raise bad


def _coerce_list(annotation: Any, value: Any, *, field: str, source: str) -> list[Any]:
    """A list from a list, or from a CLI string: YAML/JSON (`[]`, `[1, 3]`) or comma-separated
    (`1,3`); each item is coerced to the annotated item type."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                value = yaml.safe_load(text)
            except yaml.YAMLError as err:
                raise ArgumentError(f"{field} in {source} is not a valid list: {err}") from None
        else:
            value = [item.strip() for item in text.split(",") if item.strip()]
    if isinstance(value, tuple):
        value = list(value)
    if not isinstance(value, list):
        raise ArgumentError(
            f"{field} in {source} must be a list (e.g. [1, 3] or 1,3), got {value!r}."
        )
    (item_type,) = typing.get_args(annotation) or (Any,)
    if item_type is Any:
        return value
    return [
        coerce_value(item_type, item, field=f"{field}[{i}]", source=source)
        for i, item in enumerate(value)
    ]
