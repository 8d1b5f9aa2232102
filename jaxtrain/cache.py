"""Where jaxtrain keeps what it computes once per machine, and JAX's compilation cache there.

The root is `$JAXTRAIN_CACHE`, default `~/.cache/jaxtrain`: the default corpus's tokenizers,
the CPU's measured peak (observability/hardware.py) and, under `xla/`, the XLA programs JAX
compiled, so a rerun, a resume or the next trial of a sweep loads its train step instead of
compiling it again (JAX keys each program by its HLO, flags and jax version; programs that
compile in under `jax_persistent_cache_min_compile_time_secs`, 1 s by default, are not kept).
"""

from __future__ import annotations

import os
from pathlib import Path

# JAX evicts the least recently used programs beyond this size.
MAX_CACHE_BYTES = 4 * 2**30


def cache_root() -> Path:
    env = os.environ.get("JAXTRAIN_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "jaxtrain"


def enable_compilation_cache(setting: str | None) -> Path | None:
    """Turn on JAX's persistent compilation cache; returns the directory in use.

    `setting`: "auto" (`cache_root()/xla`), a directory, or None/"" (off). A cache directory
    already set for JAX (JAX_COMPILATION_CACHE_DIR, `jax.config`) wins over it.
    """
    import jax

    current = jax.config.jax_compilation_cache_dir
    if current:
        return Path(current)
    if not setting:
        return None
    path = cache_root() / "xla" if setting == "auto" else Path(setting)
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    if jax.config.jax_compilation_cache_max_size == -1:
        jax.config.update("jax_compilation_cache_max_size", MAX_CACHE_BYTES)
    from jax.experimental.compilation_cache import compilation_cache

    # JAX decides whether to use the cache at its first compile, which building the model
    # (its initialisers) has usually done already: let it decide again.
    compilation_cache.reset_cache()
    return path
