"""Ring attention on 4 simulated devices (sp = 4) against one device. argv[1]:

- "attention": outputs and q/k/v gradients of blockwise attention, ring vs one device, for
  causal, windowed, packed (with padding and a one-token document), soft-capped GQA rows;
  and the chunked log-probs of training/logps.py on sp meshes (values, gradients, and what
  the compiled program gathers); prints the largest errors as JSON.
- "train,<dims>": losses of 2 training steps of a windowed Llama on packed rows with
  attention_implementation="blockwise" on the mesh <dims> (argv[2]: output dir).
"""

import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
)

import json  # noqa: E402

import datasets  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import CONFIG, VOCAB, LossRecorder, parallel_arguments  # noqa: E402
from flax import nnx  # noqa: E402

from jaxtrain import Trainer  # noqa: E402
from jaxtrain.models import LlamaForCausalLM  # noqa: E402
from jaxtrain.models.attention import causal_attention  # noqa: E402
from jaxtrain.models.sharding import activation_sharding, constrain  # noqa: E402
from jaxtrain.parallel import ShardingRules, build_mesh  # noqa: E402
from jaxtrain.planning.hlo import collectives  # noqa: E402
from jaxtrain.training.logps import chunked_logp_sums, chunked_token_logps  # noqa: E402


def attention_errors() -> dict[str, float]:
    t, b = 64, 2
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(b, t, 4, 8)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, t, 2, 8)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, t, 2, 8)), jnp.float32)
    cot = jnp.asarray(rng.normal(size=(b, t, 4, 8)), jnp.float32)
    # Row 0: documents crossing shard borders (16 tokens a shard), a one-token document
    # and trailing padding (segment 0); row 1: one document.
    row = [1] * 13 + [2] * 1 + [3] * 30 + [4] * 12 + [0] * 8
    seg = jnp.asarray(np.array([row, [7] * t]), jnp.int32)
    rules = ShardingRules(build_mesh((1, 1, 1, 1, 4)))
    errors = {}
    cases = {
        "causal": dict(),
        "window": dict(sliding_window=20),
        "packed": dict(segment_ids=seg),
        "packed_window_softcap": dict(segment_ids=seg, sliding_window=11, logit_cap=2.0),
    }
    for name, kw in cases.items():

        def loss(q, k, v, kw=kw):
            out = causal_attention(q, k, v, implementation="blockwise", **kw)
            return jnp.sum(out * cot), out

        run = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
        (_, one), one_grads = run(q, k, v)
        with activation_sharding(rules):
            ring_run = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
            assert "ppermute" in str(jax.make_jaxpr(ring_run)(q, k, v))
            (_, ring), ring_grads = ring_run(q, k, v)
        for label, a, w in [("out", ring, one), *zip("qkv", ring_grads, one_grads)]:
            # atol relative to the array's scale: a token alone in its document has an
            # exact-zero dq, which both paths round to noise of either sign.
            atol = 1e-6 * float(np.abs(np.asarray(w)).max())
            np.testing.assert_allclose(a, w, rtol=1e-5, atol=atol, err_msg=f"{name} {label}")
            errors[f"{name}_{label}"] = float(np.max(np.abs(np.asarray(a) - np.asarray(w))))
    return errors


def chunked_loss_report() -> dict:
    """Chunked log-probs with the row split over sp (and dp x sp): the sums, per-token
    log-probs and their gradients against one device's, and the bytes of every array the
    compiled program all-gathers (planning/hlo.collectives). The hidden states [B, T, D] must
    stay where they are: each device computes the logits of its own positions."""
    b, t, d, vocab = 2, 64, 8, 32
    rng = np.random.default_rng(1)
    hidden = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
    head = jnp.asarray(rng.normal(size=(d, vocab)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, vocab, (b, t)), jnp.int32).at[0, :5].set(-100)

    def loss(hidden, head):
        # 5 positions a chunk: chunks cross no shard border, each device pads its part.
        sums = chunked_logp_sums(hidden, lambda h: h @ head, labels, chunk_tokens=5)
        logps, _ = chunked_token_logps(hidden, lambda h: h @ head, labels, chunk_tokens=5)
        return sums["logp_sum"] + jnp.sum(jnp.sin(logps)), logps

    one = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(hidden, head)
    report = {}
    for dims in [(1, 1, 1, 1, 4), (2, 1, 1, 1, 2)]:
        rules = ShardingRules(build_mesh(dims))

        def sharded(hidden, head, rules=rules):
            with activation_sharding(rules):
                return loss(constrain(hidden, ("batch", "length", None)), head)

        run = jax.jit(jax.value_and_grad(sharded, argnums=(0, 1), has_aux=True))
        got = run(hidden, head)
        error = max(
            float(np.max(np.abs(np.asarray(a) - np.asarray(w))) / np.max(np.abs(np.asarray(w))))
            for a, w in zip(jax.tree.leaves(got), jax.tree.leaves(one))
        )
        hlo = run.lower(hidden, head).compile().as_text()
        gathered = [c.bytes for c in collectives(hlo, 4) if c.kind == "all-gather"]
        report[",".join(map(str, dims))] = {"error": error, "gathered_bytes": gathered}
    return {"token_value_bytes": b * t * 4, "meshes": report}


def train_losses(dims: tuple[int, ...], out: str) -> list[float]:
    seq = 64
    rng = np.random.default_rng(0)
    # Documents of 5..40 tokens packed into rows of 64: boundaries fall inside shards.
    docs = [rng.integers(1, VOCAB - 1, size=int(n)).tolist() for n in rng.integers(5, 40, 24)]
    config = type(CONFIG)(**{**CONFIG.to_dict(), "sliding_window": 20, "num_hidden_layers": 2})
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    model.attention_implementation = "blockwise"
    recorder = LossRecorder()
    trainer = Trainer(
        arguments=parallel_arguments(
            out,
            sharding_axis_dims=dims,
            max_steps=2,
            total_batch_size=4,
            max_sequence_length=seq,
            packing=True,
        ),  # fmt: skip
        model=model,
        dataset_train=datasets.Dataset.from_dict({"input_ids": docs}),
        callbacks=[recorder],
        devices=jax.devices()[: int(np.prod(dims))],
    )
    trainer.train()
    return recorder.losses


if sys.argv[1] == "attention":
    print(json.dumps({"attention": attention_errors(), "chunked_loss": chunked_loss_report()}))
else:
    dims = tuple(int(d) for d in sys.argv[1].split(",")[1:])
    print(json.dumps(train_losses(dims, sys.argv[2])))
