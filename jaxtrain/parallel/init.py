"""Sharded initialisation: the model is born sharded, no host holds the full parameters.

`ModelFactory(lambda: LlamaForCausalLM(config, rngs=nnx.Rngs(0)))` is traced abstractly
(`nnx.eval_shape`) to learn every variable's shape and logical axes; the rules turn those into
shardings, and one `jax.jit(init, out_shardings=...)` then runs the initialisers -- and the
optimizer's init -- so that each device computes and stores only its own shards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.models.frozen import Frozen
from jaxtrain.parallel.plan import ShardingPlan


def cast_floating(params: Any, dtype: Any) -> Any:
    """Floating leaves (arrays or jax.ShapeDtypeStruct) cast to `dtype`; None keeps them."""
    if dtype is None:
        return params
    dtype = jnp.dtype(dtype)

    def cast(x: Any) -> Any:
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
        return x.astype(dtype)

    return jax.tree.map(cast, params)


def cast_frozen(rest: Any, dtype: Any) -> Any:
    """The frozen weights of a model's non-Param state `rest` (an nnx.State: a reference, a
    teacher, a LoRA base) cast to `dtype` like the trained ones; buffers, RNG state and a
    quantized base's codes and scales keep theirs. None keeps everything."""
    if dtype is None:
        return rest

    def cast(v: Any) -> Any:
        if isinstance(v, Frozen) and v.follows_param_dtype:
            return v.replace(cast_floating(v.get_value(), dtype))
        return v

    return jax.tree.map(cast, rest, is_leaf=lambda x: isinstance(x, nnx.Variable))


def like_dtypes(params: Any, like: Any) -> Any:
    """`params` with each leaf in the dtype of the matching leaf of `like` (arrays or
    jax.ShapeDtypeStruct). param_dtype is decided once, on the abstract parameters, by
    cast_floating; concrete parameters created later follow them with this."""
    if like is None:
        return params
    return jax.tree.map(
        lambda x, ref: x if x.dtype == ref.dtype else x.astype(ref.dtype), params, like
    )


class ModelFactory:
    """A zero-argument function building the model; pass it to Trainer(model=...).

    The Trainer keeps the abstract model (shapes and logical axes, nothing allocated) and
    creates the parameters and optimizer state sharded, in one jitted program, when the run
    starts fresh; a resumed run restores them from the checkpoint without initialising.
    """

    def __init__(self, build: Callable[[], nnx.Module]):
        if not callable(build):
            raise TypeError(
                f"ModelFactory needs a zero-argument callable returning an nnx.Module, got {build!r}."
            )
        self.build = build

    def abstract(self) -> nnx.Module:
        """The model with jax.ShapeDtypeStruct in place of arrays (nothing allocated)."""
        return nnx.eval_shape(self.build)

    def split(self, like: Any = None, rest_like: Any = None) -> tuple[Any, Any]:
        """(params, rest) of a freshly built model, in the dtypes of the abstract `like` and
        `rest_like` (None: as built); call it inside jit."""
        _, params, rest = nnx.split(self.build(), nnx.Param, ...)
        return like_dtypes(params, like), like_dtypes(rest, rest_like)

    def state_and_rest_initializer(
        self,
        make_state: Callable[[Any], Any],
        shardings: Any,
        plan: ShardingPlan,
        rest: Any,
        *,
        like: Any = None,
        compiler_options: dict[str, Any] | None = None,
    ) -> Callable[[], tuple[Any, Any]]:
        """jit of () -> (train state, non-parameter variables), both created sharded, in one
        program. `rest` is the abstract non-Param state of the model (frozen weights, buffers;
        in the dtypes the new ones take), `like` the abstract params whose dtypes the new
        params take (param_dtype)."""
        rest_like = rest

        def init() -> tuple[Any, Any]:
            params, rest = self.split(like, rest_like)
            return make_state(params), rest

        out_shardings = (shardings, plan.param_shardings(rest))
        return jax.jit(init, out_shardings=out_shardings, compiler_options=compiler_options or None)

    def create(
        self,
        plan: ShardingPlan,
        *,
        param_dtype: Any = None,
        compiler_options: dict[str, Any] | None = None,
    ) -> nnx.Module:
        """A concrete model whose variables are created sharded by `plan`'s rules."""
        graphdef, params, rest = nnx.split(self.abstract(), nnx.Param, ...)
        like = cast_floating(params, param_dtype)  # param_dtype decided once, abstractly
        rest_like = cast_frozen(rest, param_dtype)
        shardings = (plan.param_shardings(params), plan.param_shardings(rest))
        init = jax.jit(
            lambda: self.split(like, rest_like),
            out_shardings=shardings,
            compiler_options=compiler_options or None,
        )
        params, rest = init()
        return nnx.merge(graphdef, params, rest)
