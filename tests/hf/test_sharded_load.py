"""Loading onto a device mesh: each parameter lands on the sharding `sharding_for` picks, each
device holding only its slice, with the same values and logits as a single-device load."""

import os
import subprocess
import sys
from pathlib import Path

from hf_fixtures import save_hf

WORKER = r"""
import sys
import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec
from flax import nnx
from jaxtrain.hf import AutoModelForCausalLM, save_pretrained

assert jax.device_count() == 4, jax.devices()
mesh = jax.make_mesh((2, 2), ("fsdp", "tp"), axis_types=(AxisType.Auto, AxisType.Auto))
rules = {"embed": "fsdp", "vocab": "tp", "mlp": "tp", "kv_heads": "tp", "heads": "tp"}
calls = {}

def sharding_for(path, shape, logical_axes):
    calls[path] = (shape, logical_axes)
    if path.endswith("norm/weight"):
        return None  # None: the default placement
    spec = PartitionSpec(*[rules.get(axis) for axis in logical_axes])
    return NamedSharding(mesh, spec)

sharded = AutoModelForCausalLM.from_pretrained(sys.argv[1], sharding_for=sharding_for)
plain = AutoModelForCausalLM.from_pretrained(sys.argv[1])
flat = dict(nnx.to_flat_state(nnx.state(sharded, nnx.Param)))
reference = dict(nnx.to_flat_state(nnx.state(plain, nnx.Param)))
assert set(calls) == {"/".join(map(str, p)) for p in flat}, sorted(calls)
assert calls["model/layers/0/self_attn/qkv_proj/kernel"] == (
    (32, 2, 4, 8), ("embed", "kv_heads", "qkv", "head_dim"))
split = 0
for path, var in flat.items():
    name = "/".join(map(str, path))
    array = var[...]
    np.testing.assert_array_equal(np.asarray(array), np.asarray(reference[path][...]))
    if name.endswith("norm/weight"):
        continue
    expected = sharding_for(name, *calls[name])
    assert array.sharding.is_equivalent_to(expected, array.ndim), name
    for shard in array.addressable_shards:  # every device holds its slice only
        assert shard.data.shape == expected.shard_shape(array.shape), name
    split += any(s.data.shape != array.shape for s in array.addressable_shards)
assert split >= 5, split
ids = np.random.RandomState(0).randint(0, 320, size=(2, 12))
np.testing.assert_allclose(
    np.asarray(jax.jit(lambda m, x: m(x))(sharded, ids)), np.asarray(jax.jit(lambda m, x: m(x))(plain, ids)),
    rtol=1e-5, atol=1e-5)
# A sharded model exports too (each parameter gathered in turn), and nothing imported torch.
out = save_pretrained(sharded, sys.argv[2])
back = AutoModelForCausalLM.from_pretrained(out)
for path, var in nnx.to_flat_state(nnx.state(back, nnx.Param)):
    np.testing.assert_array_equal(np.asarray(var[...]), np.asarray(reference[path][...]))
# Wired to the Trainer's sharding plan (what `jaxtrain train --model.pretrained` does), the
# loader places every tensor where the plan's rules, regex rules included, put it.
from jaxtrain import TrainingArguments
from jaxtrain.parallel import ShardingPlan
args = TrainingArguments(
    sharding_axis_dims=(1, 2, 1, 2, 1),
    sharding_regex_rules=[[r"down_proj/kernel$", ["tp", "fsdp"]]],
)
plan = ShardingPlan.from_arguments(args)
planned = AutoModelForCausalLM.from_pretrained(sys.argv[1], sharding_for=plan.sharding_for)
arrays = jax.tree.leaves(nnx.state(planned, nnx.Param))
wanted = jax.tree.leaves(
    plan.param_shardings(nnx.state(plain, nnx.Param)),
    is_leaf=lambda x: isinstance(x, jax.sharding.Sharding),
)
assert len(arrays) == len(wanted) == len(flat)
for array, sharding in zip(arrays, wanted):
    assert array.sharding.is_equivalent_to(sharding, array.ndim), (array.shape, sharding)
down = nnx.state(planned, nnx.Param)["model"]["layers"][0]["mlp"]["down_proj"]["kernel"][...]
assert tuple(down.sharding.spec) == ("tp", "fsdp"), down.sharding.spec
assert "torch" not in sys.modules
print("ok", split)
"""


def test_weights_are_placed_directly_on_their_shards(tmp_path):
    save_hf("llama", tmp_path / "hf")
    env = {
        **os.environ,
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(Path(__file__).parents[2]),
    }
    result = subprocess.run(
        [sys.executable, "-c", WORKER, str(tmp_path / "hf"), str(tmp_path / "export")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("ok")
