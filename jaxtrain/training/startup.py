"""The start-up summary (seed 002): what a run ran with, at every start, not only --dry_run.

Versions (jax, jaxlib, flax, optax, orbax, python), the JAX/XLA settings in force
(XLA_FLAGS, the run's XLA compiler options, x64, the compilation cache), the partition rules
that placed each parameter (compact: layer indices folded into `*`) and the per-device
memory estimate of parallel/dry_run.py. The loop prints a few lines of it once (process 0)
and the monitor writes all of it into run_info.json ("startup"): a run that behaves
differently from last week's can be compared setting by setting.
"""

from __future__ import annotations

import os
import platform
import re
from importlib import metadata
from typing import Any

import jax
from flax import nnx

from jaxtrain.config.sections import RunSettings
from jaxtrain.parallel.dry_run import human_bytes, memory_estimate
from jaxtrain.pytrees import path_str

PACKAGES = {
    "jax": "jax",
    "jaxlib": "jaxlib",
    "flax": "flax",
    "optax": "optax",
    "orbax": "orbax-checkpoint",
}


def versions() -> dict[str, str]:
    """Installed versions of the stack the run's numbers depend on."""
    found = {"python": platform.python_version()}
    for name, distribution in PACKAGES.items():
        try:
            found[name] = metadata.version(distribution)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def jax_settings(program: Any) -> dict[str, Any]:
    """The JAX and XLA settings that change what is compiled or how fast it starts."""
    return {
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
        # glibc.malloc.hugetlb=1 made CPU steps 10-20% faster (docs/training.md, "What the step computes")
        "GLIBC_TUNABLES": os.environ.get("GLIBC_TUNABLES", ""),
        "xla_compiler_options": dict(program.runtime.compiler_options or {}),
        "jax_enable_x64": bool(jax.config.jax_enable_x64),
        "jax_compilation_cache_dir": jax.config.jax_compilation_cache_dir,
        "backend": jax.default_backend(),
    }


def partition_rules(program: Any) -> dict[str, str]:
    """Parameter pattern -> 'spec <- the rule that gave it', one entry per pattern (layer
    indices folded into `*`; a pattern whose layers differ keeps one entry per layer)."""
    rules = program.plan.rules
    params = program.abstract_state().params
    leaves = jax.tree_util.tree_leaves_with_path(
        params, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    shardings = jax.tree.leaves(program.state_shardings.params)
    by_path: dict[str, str] = {}
    for (path, var), sharding in zip(leaves, shardings, strict=True):
        name = path_str(path)
        regex = next((p.pattern for p, _ in rules.regex_rules if p.search(name)), None)
        if regex is not None:
            source = f"regex {regex!r}"
        else:
            axes = var.get_metadata().get("logical_axes") if isinstance(var, nnx.Variable) else None
            source = f"logical axes {tuple(axes)}" if axes else "replicated (no logical axes)"
        by_path[name] = f"{tuple(sharding.spec)} <- {source}"
    compact: dict[str, str] = {}
    groups: dict[str, set[str]] = {}
    for name, rule in by_path.items():
        groups.setdefault(re.sub(r"/\d+(?=/|$)", "/*", name), set()).add(rule)
    for name, rule in by_path.items():
        pattern = re.sub(r"/\d+(?=/|$)", "/*", name)
        compact[pattern if len(groups[pattern]) == 1 else name] = rule
    return compact


def startup_summary(program: Any, settings: RunSettings) -> dict[str, Any]:
    """Everything above for a Program and its run's settings, JSON-ready (run_info.json's
    "startup")."""
    return {
        "versions": versions(),
        "jax_settings": jax_settings(program),
        "partition_rules": partition_rules(program),
        "memory_per_device_bytes": memory_estimate(program, settings.data),
    }


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """The few lines printed at start; the whole rule list is only in run_info.json."""
    v, s = summary["versions"], summary["jax_settings"]
    m = summary["memory_per_device_bytes"]
    memory = ", ".join(
        f"{label} {human_bytes(m[key])}"
        for key, label in (
            ("parameters", "params"),
            ("optimizer_state", "optimizer"),
            ("frozen", "frozen"),
            ("activations", "activations ~"),
            ("total", "total ~"),
        )
        if m.get(key) is not None and (m[key] or key != "frozen")  # no frozen weights: left out
    ).replace("~ ", "~")
    rules = summary["partition_rules"]
    return [
        "versions: "
        + ", ".join(f"{k} {v[k]}" for k in ("jax", "jaxlib", "flax", "optax", "orbax"))
        + f", python {v['python']}",
        f"jax: backend {s['backend']}, x64 {'on' if s['jax_enable_x64'] else 'off'}, "
        f"compilation cache {s['jax_compilation_cache_dir'] or 'off'}, "
        f"XLA_FLAGS {s['XLA_FLAGS'] or '(unset)'}, compiler options "
        f"{s['xla_compiler_options'] or '{}'}"
        + (f", GLIBC_TUNABLES {s['GLIBC_TUNABLES'] or '(unset)'}" if s["backend"] == "cpu" else ""),
        f"memory per device: {memory}; partition rules: {len(rules)} parameter patterns "
        "(run_info.json lists pattern -> spec)",
    ]
