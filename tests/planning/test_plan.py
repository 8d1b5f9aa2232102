"""`jaxtrain plan`: the plan of a run equals the run (memory, FLOPs), its collectives equal
the analytical volumes, and the HLO reader handles XLA's spellings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

from jaxtrain.cli import main
from jaxtrain.planning.accelerators import ACCELERATORS
from jaxtrain.planning.hlo import collectives
from jaxtrain.planning.hlo_costs import matmul_flops, memory_traffic
from jaxtrain.planning.roofline import estimate

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def measured():
    """tests/planning/plan_worker.py: plans and a real run on 8 CPU devices (one process),
    under the suite's XLA flags and compilation cache (tests/conftest.py): the plans and the
    run compile with the same flags, which is all the comparisons need."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("plan_worker.py"))],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_the_plan_s_memory_is_what_the_run_compiles(measured):
    assert measured["run_peak"] > 0
    assert measured["plan_peak"] == pytest.approx(measured["run_peak"], rel=0.05)


def test_the_plan_s_flops_are_the_trainer_s(measured):
    assert measured["plan_model_flops"] == pytest.approx(measured["trainer_flops"], rel=0.02)
    # The compiled program's matmuls are the analytical count with full (masked) attention
    # scores, which XLA computes in full.
    assert measured["plan_matmul_flops"] == pytest.approx(
        measured["analytic_full_attention"], rel=0.02
    )


def test_fsdp_collectives_are_one_gather_and_one_scatter_of_the_parameters(measured):
    """fsdp=8, 2 micro-batches: the parameters are gathered once (the gathers are hoisted out
    of the accumulation loop) and their gradients reduce-scattered once per micro-batch."""
    found, params = measured["fsdp_collectives"], measured["parameter_bytes"]
    assert found["all-gather"]["bytes"] == pytest.approx(params, rel=0.05)
    assert found["reduce-scatter"]["bytes"] == pytest.approx(2 * params, rel=0.05)
    assert found.get("all-reduce", {"bytes": 0})["bytes"] < 0.01 * params  # scalars only


def test_a_tp_plan_all_reduces_in_every_layer(measured):
    found = measured["tp_collectives"]
    # Forward and backward, attention and MLP: at least 4 per layer.
    assert found["all-reduce"]["count"] >= 4 * measured["layers"]
    assert found["all-reduce"]["bytes"] > 0


def test_two_compiled_layers_scaled_to_six_equal_the_whole_model(measured):
    whole, unit = measured["whole"], measured["unit"]
    assert "scaled" in measured["unit_method"]
    for key in whole:
        assert unit[key] == pytest.approx(whole[key], rel=0.02), key
    for kind, c in measured["whole_collectives"].items():
        assert measured["unit_collectives"][kind]["bytes"] == pytest.approx(c["bytes"], rel=0.02)


HLO = """HloModule m

%body (p: (s32[], f32[8,4])) -> (s32[], f32[8,4]) {
  %p = (s32[], f32[8,4]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8,4]{1,0} get-tuple-element(%p), index=1
  %g = f32[16,4]{1,0} all-gather(%x), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}
  %w = f32[4,4]{1,0} constant({...})
  %d = f32[16,4]{1,0} dot(%g, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %r = f32[16,4]{1,0} all-reduce(%d), channel_id=2, replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add
  %z = s32[] constant(0)
  %s = f32[8,4]{1,0} dynamic-slice(%r, %i, %z), dynamic_slice_sizes={8,4}
  ROOT %t = (s32[], f32[8,4]) tuple(%i, %s)
}

%cond (c: (s32[], f32[8,4])) -> pred[] {
  %c = (s32[], f32[8,4]) parameter(0)
  ROOT %k = pred[] constant(true)
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

ENTRY %main (x: f32[8,4]) -> f32[8,4] {
  %x0 = f32[8,4]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,4]) tuple(%zero, %x0)
  %loop = (s32[], f32[8,4]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %y = f32[8,4]{1,0} get-tuple-element(%loop), index=1
  %m = f32[8,4]{1,0} all-reduce(%y), channel_id=3, replica_groups=mesh['a'=2,'b'=4] {'b'}, to_apply=%add
  ROOT %out = f32[8,4]{1,0} add(%m, %m)
}
"""


def test_a_plan_counts_at_least_the_model_s_flops():
    """XLA:GPU counts no FLOPs in cuDNN's attention calls: on an H200 the compiled matmuls
    were 0.85x the model's FLOPs and the plan read 118% MFU (bench/RESULTS.md, session 27)."""
    figures = {"matmul_flops": 1.017e14, "model_flops": 1.198e14, "bytes_accessed": 1e9,
               "collective_ops": [], "peak_bytes": 1e9, "shape_estimate_bytes": 1e9}  # fmt: skip
    est = estimate(figures, ACCELERATORS["h200"], devices=1, per_node=1, dtype=jnp.bfloat16)
    assert est["compute_s"] == pytest.approx(1.198e14 / ACCELERATORS["h200"].bf16_flops)
    assert est["mfu"]["serial"] == pytest.approx(1.0) and est["bound"] == "compute"
    # Where the compiled program does more (remat's recompute), its count stands.
    figures["matmul_flops"] = 1.5e14
    est = estimate(figures, ACCELERATORS["h200"], devices=1, per_node=1, dtype=jnp.bfloat16)
    assert est["mfu"]["serial"] == pytest.approx(1.198 / 1.5)


def test_the_hlo_reader_counts_loops_groups_and_scatters():
    by_kind = {}
    for c in collectives(HLO, 8):
        by_kind.setdefault(c.kind, []).append(c)
    (gather,) = by_kind["all-gather"]
    assert (gather.executions, gather.group_size, gather.bytes) == (3, 4, 16 * 4 * 4)
    assert gather.groups == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # Only half of the loop's all-reduce is ever used: on an accelerator, a reduce-scatter.
    (scatter,) = by_kind["reduce-scatter"]
    assert (scatter.executions, scatter.group_size, scatter.groups[1]) == (3, 2, [2, 3])
    (reduced,) = by_kind["all-reduce"]  # the entry's: its whole result is used
    assert (reduced.executions, reduced.group_size) == (1, 4)
    assert reduced.groups == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert reduced.link_bytes == 2 * 3 / 4 * 8 * 4 * 4
    assert matmul_flops(HLO) == 3 * 2 * 16 * 4 * 4
    assert memory_traffic(HLO) > 0


def test_jaxtrain_plan_sweeps_meshes_and_writes_plan_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code = main(
        [
            "plan",
            "--devices",
            "4",
            "--accelerator",
            "a100",
            "--sweep",
            "--output",
            str(out),
            "--total_batch_size",
            "8",
            "--max_sequence_length",
            "64",
            "--model.num_hidden_layers",
            "2",
            "--model.vocab_size",
            "512",
            "--model.num_attention_heads",
            "4",
            "--model.num_key_value_heads",
            "2",
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0, printed
    plan = json.loads(out.read_text())
    meshes = [m["mesh"] for m in plan["meshes"]]
    assert [1, 4, 1, 1, 1] in meshes and [4, 1, 1, 1, 1] in meshes and [2, 1, 1, 2, 1] in meshes
    planned = [m for m in plan["meshes"] if "estimate" in m]
    assert planned and all(m["estimate"]["fits"] for m in planned)
    times = [m["estimate"]["step_time_s"]["serial"] for m in planned]
    assert times == sorted(times)  # ranked by predicted step time
    assert plan["accelerator"]["name"] == "NVIDIA A100 SXM 80GB"
    assert "FLOPs per step" in printed and "collectives per step" in printed


def test_a_plan_s_vocabulary_is_the_data_tokenizer_s_as_in_a_run(tmp_path):
    """The plan's model had the config's default vocabulary whatever the data's tokenizer:
    a Llama 3 tokenizer (128k tokens) planned as 4096."""
    import transformers
    from tokenizers import ByteLevelBPETokenizer

    from jaxtrain.cli.plan import model_spec

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["the quick brown fox"] * 10, vocab_size=300, min_frequency=1)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe)
    tokenizer.save_pretrained(tmp_path / "tok")
    options = {"hf_config": None}
    section = {"hidden_size": 64}
    assert model_spec(options, section, {"source": "default", "vocab_size": 384}) == {
        "hidden_size": 64, "vocab_size": 384,
    }  # fmt: skip
    files = {"source": "files", "tokenizer": str(tmp_path / "tok")}
    assert model_spec(options, section, files)["vocab_size"] == len(tokenizer)
    assert model_spec(options, {**section, "vocab_size": 999}, files)["vocab_size"] == 999
    assert "vocab_size" not in model_spec(options, section, {"source": "files"})


def test_plan_refuses_an_unknown_accelerator_and_a_bad_device_count(capsys):
    assert main(["plan", "--accelerator", "tpu-v9"]) == 2
    assert "--accelerator 'tpu-v9': choose one of h100" in capsys.readouterr().err
    assert main(["plan", "--devices", "0"]) == 2
    assert "--devices must be a positive integer" in capsys.readouterr().err


def test_a_batch_the_mesh_cannot_split_is_named_in_one_line(tmp_path, capsys):
    """2 rows over fsdp=4 failed inside the compile with JAX's sharding traceback; the plan
    now runs the run's own check (parallel/batch.py) and says why, as `jaxtrain train` does."""
    code = main(
        ["plan", "--devices", "4", "--accelerator", "a100", "--output", str(tmp_path / "p.json"),
         "--total_batch_size", "2", "--max_sequence_length", "64",
         "--model.num_hidden_layers", "1", "--model.vocab_size", "256",
         "--model.num_attention_heads", "4", "--model.num_key_value_heads", "2"]
    )  # fmt: skip
    printed = capsys.readouterr()
    assert code == 2, printed.out[-2000:]
    assert "cannot run: micro-batch size=2 is not divisible by dp*fsdp=4" in printed.out
    assert "Traceback" not in printed.out + printed.err


def test_plan_choices_compiles_each_setting_changed_alone(tmp_path, capsys):
    out = tmp_path / "plan.json"
    hidden, inter, layers, kv_heads, heads = 64, 128, 2, 2, 4
    model = ["--model.hidden_size", str(hidden), "--model.intermediate_size", str(inter),
             "--model.num_hidden_layers", str(layers), "--model.num_attention_heads", str(heads),
             "--model.num_key_value_heads", str(kv_heads), "--model.vocab_size", "256"]  # fmt: skip
    run = ["--total_batch_size", "4", "--max_sequence_length", "64", "--dtype", "bfloat16"]
    code = main(["plan", "--choices", "--devices", "1", "--accelerator", "h100",
                 "--output", str(out), *run, *model])  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0, printed
    entries = {e["choice"]: e for e in json.loads(out.read_text())["meshes"]}
    labels = ["as configured", "scan_layers=true", "mu_dtype=bfloat16", "fp8_matmuls=true"]
    assert list(entries) == labels and all("estimate" in e for e in entries.values())
    assert all(label in printed for label in labels) and "choices on" in printed
    base, moments = entries["as configured"]["figures"], entries["mu_dtype=bfloat16"]["figures"]
    # AdamW's first moments in bfloat16: its state is 3/4 of two float32 moments.
    assert moments["state"]["optimizer_state"] / base["state"]["optimizer_state"] == (
        pytest.approx(0.75, rel=0.01)
    )
    # Float8 projections: every decoder projection's weights (not the head), 6 FLOPs per
    # weight per token, counted at the H100's FP8 rate (twice its bf16 rate).
    fp8 = entries["fp8_matmuls=true"]
    head_dim = hidden // heads
    weights = layers * (2 * hidden * hidden + 2 * hidden * kv_heads * head_dim + 3 * hidden * inter)
    assert fp8["figures"]["fp8_model_flops"] == 6 * weights * 4 * 64
    assert base["fp8_model_flops"] == 0
    h100 = ACCELERATORS["h100"]
    faster = fp8["figures"]["fp8_model_flops"] * (1 / h100.bf16_flops - 1 / h100.fp8_flops)
    compute = entries["as configured"]["estimate"]["compute_s"]
    expected = max(fp8["figures"]["matmul_flops"], fp8["figures"]["model_flops"]) / h100.bf16_flops
    assert fp8["estimate"]["compute_s"] == pytest.approx(expected - faster)
    assert fp8["estimate"]["compute_s"] < compute
    # Without an FP8 rate of its own (an A100), float8 operands buy no compute time.
    one_device = {**fp8["figures"], "collective_ops": []}  # plan.json leaves the list out
    a100 = estimate(one_device, ACCELERATORS["a100"], devices=1, per_node=1, dtype="bfloat16")
    assert a100["compute_s"] == pytest.approx(expected * h100.bf16_flops / 312e12)
    assert main(["plan", "--choices", "--sweep", *run, *model]) == 2
    assert "--choices compares settings on the run's own mesh" in capsys.readouterr().err
