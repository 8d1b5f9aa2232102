"""Compile tracking: each compile is reported; a recompile names the shapes that changed."""

import logging

import jax.numpy as jnp
import numpy as np

from jaxtrain.observability.compiles import TrackedJit


def step(params, batch):
    return params["w"] * batch["x"].sum()


def test_same_shapes_compile_once_and_stay_quiet(caplog):
    events = []
    fn = TrackedJit(step, "toy_step", events.append)
    params = {"w": jnp.ones(())}
    with caplog.at_level(logging.INFO, logger="jaxtrain.compile"):
        for value in range(3):
            fn(params, {"x": np.full((4, 8), value, np.float32)})
    assert len(events) == 1 and not events[0].is_recompile and events[0].seconds > 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "compiled toy_step in" in caplog.text


def test_a_shape_change_recompiles_with_a_warning_naming_the_argument(caplog):
    events = []
    fn = TrackedJit(step, "toy_step", events.append)
    params = {"w": jnp.ones(())}
    fn(params, {"x": np.zeros((4, 8), np.float32)})
    with caplog.at_level(logging.WARNING, logger="jaxtrain.compile"):
        result = fn(params, {"x": np.ones((4, 16), np.float32)})
    assert float(result) == 64.0
    assert len(events) == 2 and events[1].is_recompile
    assert events[1].changes == ["args[1]['x']: float32[4, 8] -> float32[4, 16]"]
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "recompiled toy_step" in warning.message
    assert "args[1]['x']: float32[4, 8] -> float32[4, 16]" in warning.message
    # Going back to a shape seen before reuses its executable: no third compile.
    fn(params, {"x": np.zeros((4, 8), np.float32)})
    assert len(events) == 2


def test_a_dtype_change_is_named_too():
    events = []
    fn = TrackedJit(step, "toy_step", events.append)
    fn({"w": jnp.ones(())}, {"x": np.zeros((2,), np.float32)})
    fn({"w": jnp.ones(())}, {"x": np.zeros((2,), np.int32)})
    assert events[1].changes == ["args[1]['x']: float32[2] -> int32[2]"]


def test_the_train_step_compiles_once_per_process(resumed_run):
    from jaxtrain.observability.logs import read_jsonl

    records = read_jsonl(resumed_run.out_dir / "metrics.jsonl")
    compiles = [r for r in records if "compile/train_step_s" in r]
    assert len(compiles) == 2 and all(r["compile/train_step_count"] == 1 for r in compiles)
    assert all(r["compile/train_step_s"] > 0 for r in compiles)
    # The eval step's compile is logged too (once per process: steps 6 and 12 evaluate).
    evals = [r for r in records if "compile/eval_step_s" in r]
    assert [r["step"] for r in evals] == [6, 12]
