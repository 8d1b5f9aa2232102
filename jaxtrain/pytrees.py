"""Names of pytree leaves: one spelling of a parameter's path everywhere.

A leaf module (imports nothing from jaxtrain) so models, parallel, observability and hf all
name a parameter the same way: 'model/layers/0/mlp/down_proj/kernel'.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def path_str(path: Sequence[Any]) -> str:
    """'model/layers/0/mlp/down_proj/kernel' for a pytree key path or an nnx path tuple.

    Accepts jax key entries (DictKey.key, GetAttrKey.name, SequenceKey.idx) and plain
    str/int parts; a trailing `value` (the array inside an nnx.Variable) is dropped.
    """
    names = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
    if names and names[-1] == "value":
        names = names[:-1]
    return "/".join(names)
