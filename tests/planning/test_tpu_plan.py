"""`jaxtrain plan --accelerator v5e --topology 2x2`: the step compiled by the real TPU compiler
with no TPU attached, read and checked against the XLA:CPU plan of the same step; and what a
plan says when the target's compiler is not there.

libtpu comes from `make test` (the Makefile installs it beside the venv, in <venv>/tpu; the
environment variable JAXTRAIN_TEST_LIBTPU names another folder); the TPU test is skipped
without it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxtrain.cli import main
from jaxtrain.observability.compiles import memory_summary
from jaxtrain.planning.hlo import collectives
from jaxtrain.planning.hlo_costs import matmul_flops
from jaxtrain.planning.targets import compile_target

ROOT = Path(__file__).resolve().parents[2]
LIBTPU = Path(os.environ.get("JAXTRAIN_TEST_LIBTPU") or Path(sys.prefix) / "tpu")
SMALL = [
    "--total_batch_size", "8",
    "--gradient_accumulation_steps", "2",
    "--max_sequence_length", "64",
    "--model.num_hidden_layers", "1",
    # Multiples of 128: XLA:TPU pads a smaller dimension to its (8, 128) tiles.
    "--model.hidden_size", "128",
    "--model.intermediate_size", "384",
    "--model.vocab_size", "512",
    "--model.num_attention_heads", "4",
    "--model.num_key_value_heads", "2",
]  # fmt: skip


def plan(tmp_path: Path, name: str, *flags: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(LIBTPU)])
    out = tmp_path / f"{name}.json"
    done = subprocess.run(
        [sys.executable, "-m", "jaxtrain.cli", "plan", *SMALL, *flags, "--output", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return {**json.loads(out.read_text()), "printed": done.stdout}


@pytest.mark.skipif(not (LIBTPU / "libtpu").is_dir(), reason=f"no libtpu in {LIBTPU} (make test)")
def test_a_tpu_plan_is_the_tpu_compiler_s_and_agrees_with_the_cpu_plan(tmp_path):
    tpu = plan(tmp_path, "tpu", "--accelerator", "v5e", "--topology", "2x2")
    cpu = plan(tmp_path, "cpu", "--accelerator", "v5e", "--topology", "2x2", "--compiler", "cpu")
    assert tpu["compiler"]["compiler"] == "XLA:TPU"
    assert tpu["compiler"]["description"].startswith("v5e:2x2 (TPU v5 lite, libtpu ")
    assert "compiled by XLA:TPU for v5e:2x2" in tpu["printed"]
    assert cpu["compiler"] == {
        "compiler": "XLA:CPU",
        "platform": "cpu",
        "description": "4 virtual CPU devices",
        "fallback_reason": "--compiler cpu",
    }
    t, c = tpu["meshes"][0]["figures"], cpu["meshes"][0]["figures"]
    # The same step: the same parameters, model FLOPs and matmuls. XLA:TPU writes its matmuls
    # as convolutions and its accumulation loop without a trip count; both are read.
    assert t["state"] == c["state"] and t["model_flops"] == c["model_flops"]
    assert t["matmul_flops"] == pytest.approx(c["matmul_flops"], rel=1e-6)
    # Memory: the TPU compiler's own peak, above the state it holds. Its temp_size is 0 for
    # this step (the accumulation loop's buffers are left out): the temporaries are what
    # the peak adds to the inputs and outputs. Which of XLA:CPU, XLA:TPU and the shapes is
    # highest depends on the model: on this toy XLA:TPU's (8, 128) tiles weigh most (the
    # 8B and 70B figures are in bench/RESULTS.md).
    state = t["state"]["parameters"] + t["state"]["optimizer_state"]
    assert t["peak_bytes"] == t["memory"]["peak"] > t["memory"]["arguments"] >= state
    assert t["memory"]["temporaries"] > 0
    assert 0.5 < t["peak_bytes"] / c["peak_bytes"] < 2
    assert sum(k["count"] for k in t["collectives"].values()) > 0


def test_without_the_target_s_compiler_the_plan_says_which_figure_it_uses():
    spec = {"accelerator": "v5e", "topology": "2x2", "devices": 1, "compiler": "auto"}
    import importlib.util

    if importlib.util.find_spec("libtpu") is None:  # this process has no libtpu
        target, devices = compile_target(spec)
        assert (target.compiler, len(devices)) == ("XLA:CPU", 1)
        assert target.fallback_reason == (
            "no TPU compiler: libtpu is not installed (pip install 'jaxtrain[tpu]')"
        )
    target, _ = compile_target({**spec, "accelerator": "h100"})
    if target.compiler == "XLA:CPU":  # no CUDA plugin or no GPU here
        assert target.fallback_reason.startswith("no GPU compiler (it needs the CUDA plugin")


def test_topology_flags_are_checked(capsys):
    assert main(["plan", "--accelerator", "v5e"]) == 2
    assert "--accelerator v5e plans a TPU slice: give its chips with --topology" in (
        capsys.readouterr().err
    )
    assert main(["plan", "--accelerator", "v5p", "--topology", "2x2"]) == 2
    assert "a v5p slice is 3 chip counts joined by 'x', e.g. --topology 2x2x2" in (
        capsys.readouterr().err
    )
    assert main(["plan", "--accelerator", "v6e", "--topology", "2x4", "--devices", "4"]) == 2
    assert "--devices 4 disagrees with --topology 2x4 (8 chips)" in capsys.readouterr().err
    assert main(["plan", "--accelerator", "h100", "--topology", "2x2"]) == 2
    assert "--topology describes a TPU slice" in capsys.readouterr().err


# What XLA:TPU writes for a batched matmul [2 batches] x [4, 128, 32] . [32, 128]: the batch
# dimensions become spatial ones with a dilated window, so that only one tap in two is real.
TPU_HLO = """HloModule m

%cond (c: (s32[], f32[2,4])) -> pred[] {
  %c = (s32[], f32[2,4]) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p: (s32[], f32[2,4])) -> (s32[], f32[2,4]) {
  %p = (s32[], f32[2,4]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[2,4]{1,0} get-tuple-element(%p), index=1
  %w = f32[4,4]{1,0} constant({...})
  %d = f32[2,4]{1,0} convolution(%x, %w), window={size=1}, dim_labels=bf_io->bf
  %s = (f32[2,4]{1,0}, f32[2,4]{1,0}, u32[], u32[]) collective-permute-start(%d), channel_id=1, source_target_pairs={{0,1},{1,0}}
  %e = f32[2,4]{1,0} collective-permute-done(%s)
  ROOT %t = (s32[], f32[2,4]) tuple(%i, %e)
}

ENTRY %main (x: f32[2,4]) -> f32[2,4] {
  %x0 = f32[2,4]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[2,4]) tuple(%zero, %x0)
  %loop = (s32[], f32[2,4]) while(%init), condition=%cond, body=%body
  ROOT %y = f32[2,4]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_tpu_convolutions_loops_and_asynchronous_permutes_are_counted():
    # A matmul as a convolution, in a loop whose count is only in its condition (i < 3,
    # from 0): 3 trips of 2 x 2 rows x 4 outputs x 4 inputs.
    assert matmul_flops(TPU_HLO) == 3 * 2 * 2 * 4 * 4
    # XLA:TPU turns a weight's all-gather into a ring of asynchronous permutes whose start
    # returns (operand, result, two counters): each sends its operand, once per trip.
    (permute,) = collectives(TPU_HLO, 2)
    assert permute.kind == "collective-permute"
    assert (permute.bytes, permute.executions) == (2 * 4 * 4, 3)


@pytest.mark.parametrize(
    "strides, padding, lhs_dilation, rhs_dilation, groups",
    [
        ((1, 1), ((1, 1), (0, 2)), (1, 1), (1, 1), 1),
        ((2, 3), ((1, 1), (0, 2)), (2, 3), (1, 2), 1),  # dilated input: holes read nothing
        ((1, 2), ((2, 1), (1, 1)), (3, 1), (2, 1), 4),  # feature groups
    ],
)
def test_convolution_flops_equal_xla_s_own_count(
    strides, padding, lhs_dilation, rhs_dilation, groups
):
    """XLA:TPU spells a batched matmul as a convolution with a dilated window; its FLOPs
    are counted as XLA's own cost analysis counts a convolution (valid taps only)."""
    import jax
    import jax.numpy as jnp

    def conv(a, b):
        return jax.lax.conv_general_dilated(
            a, b, strides, padding, lhs_dilation, rhs_dilation, feature_group_count=groups
        )

    rhs = (8, 8 // groups, 3, 2)
    lowered = jax.jit(conv).lower(
        jax.ShapeDtypeStruct((2, 8, 9, 7), jnp.float32), jax.ShapeDtypeStruct(rhs, jnp.float32)
    )
    text = lowered.as_text(dialect="hlo")
    assert "convolution(" in text
    assert matmul_flops(text) == lowered.cost_analysis()["flops"] > 0


class Analysis:
    """A compiled program's memory_analysis() as XLA:TPU filled it for a 2-micro-batch step."""

    argument_size_in_bytes = 3506176
    output_size_in_bytes = 3505664
    alias_size_in_bytes = 3502080
    temp_size_in_bytes = 0
    generated_code_size_in_bytes = 11480064
    peak_memory_in_bytes = 14316544


class Executable:
    def memory_analysis(self):
        return Analysis()


def test_the_tpu_peak_is_the_compiler_s_own():
    tpu = memory_summary(Executable(), "tpu")
    assert tpu["peak"] == 14316544
    assert tpu["temporaries"] == 14316544 - (3506176 + 3505664 - 3502080)
    # Elsewhere the sum (XLA:CPU's peak_memory_in_bytes is smaller than its temporaries).
    assert memory_summary(Executable(), "cpu")["peak"] == 3506176 + 3505664 - 3502080


@pytest.mark.skipif(not (LIBTPU / "libtpu").is_dir(), reason=f"no libtpu in {LIBTPU} (make test)")
def test_the_engine_groups_decode_rows_by_the_target_s_platform_not_the_laptop_s():
    """A CPU decode step gathers its pages 8 rows at a time (serving/paged.py); a TPU's
    gathers them at once. A plan of a TPU target made on this CPU compiles the TPU's."""
    code = (
        "import jax\n"
        "from jaxtrain.planning.targets import compile_target\n"
        "from jaxtrain.serving.paged import CPU_DECODE_ROWS, decode_row_group\n"
        "target, devices = compile_target({'accelerator': 'v5e', 'topology': '2x2', "
        "'devices': 4})\n"
        "assert target.platform == 'tpu', target\n"
        "mesh = jax.sharding.Mesh(devices, ('fsdp',))\n"
        "on = lambda d: jax.sharding.NamedSharding(d, jax.sharding.PartitionSpec())\n"
        "cpu = jax.sharding.Mesh(jax.devices('cpu')[:1], ('fsdp',))\n"
        "print(decode_row_group(on(mesh)), decode_row_group(on(cpu)), CPU_DECODE_ROWS)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(LIBTPU)])
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-3:] == ["0", "8", "8"], done.stdout


MOE_DEFAULT_ON_TPU = """
from jaxtrain.models.moe_dispatch import default_implementation, platform_kernel
from jaxtrain.models.sharding import activation_sharding, step_platform
from jaxtrain.parallel import ShardingRules
from jaxtrain.parallel.mesh import build_mesh
from jaxtrain.planning.targets import compile_target

_, devices = compile_target({"accelerator": "v5e", "topology": "2x2", "devices": 4})
with activation_sharding(ShardingRules(build_mesh((4, 1, 1, 1, 1), devices))):
    print(default_implementation(*step_platform()), platform_kernel("pallas"))
print(default_implementation(*step_platform()))
"""


@pytest.mark.skipif(not (LIBTPU / "libtpu").is_dir(), reason=f"no libtpu in {LIBTPU} (make test)")
def test_a_step_traced_for_tpu_devices_takes_the_tpu_s_moe_dispatch():
    """A TPU plan of a MoE model compiled on this CPU once took the CPU's blocked loop: the
    default read the host's backend, not the devices the step is traced for."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(LIBTPU)])
    done = subprocess.run([sys.executable, "-c", MOE_DEFAULT_ON_TPU], capture_output=True,
                          text=True, env=env, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["ragged_dot", "tpu", "blocks"]
