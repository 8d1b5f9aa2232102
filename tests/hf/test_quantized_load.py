"""A QLoRA base quantized as it is read (`from_pretrained(..., quantization="nf4")`, one tensor
at a time): the same codes, scales and training as a float load that the Trainer quantizes;
`jaxtrain train --model.pretrained DIR --quantization nf4` reads its base that way; a base
loaded quantized refuses full fine-tuning and another quantization, in one line."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_fixtures import random_ids, save_hf, tiny_tokenizer

from jaxtrain import Trainer, TrainingArguments
from jaxtrain.cli import main
from jaxtrain.errors import ArgumentError
from jaxtrain.hf import AutoModelForCausalLM
from jaxtrain.quantization import BaseQuantization, QuantizedKernel

BLOCK = 16  # divides the tiny model's hidden size (32) and MLP width (48)
QLORA = dict(lora_rank=4, lora_alpha=8, quantization="nf4", quantization_block_size=BLOCK)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    directory = tmp_path_factory.mktemp("base")
    save_hf("llama", directory, layers=1)
    tiny_tokenizer(directory)
    return directory


def arguments(output_dir, **overrides) -> TrainingArguments:
    values = dict(
        output_dir=str(output_dir), max_steps=3, total_batch_size=4, max_sequence_length=16,
        learning_rate=5e-2, warmup_steps=0, logging_steps=1, progress_bar="none", seed=1,
        save_final=False, run_report=False, **QLORA,
    )  # fmt: skip
    values.update(overrides)
    return TrainingArguments(**values)


def flat(tree) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}  # fmt: skip


def test_a_base_quantized_as_read_trains_like_one_quantized_by_the_trainer(base, tmp_path):
    loaded = AutoModelForCausalLM.from_pretrained(
        base, quantization=BaseQuantization("nf4", block=BLOCK)
    )
    kernels = [m for _, m in nnx.iter_modules(loaded) if isinstance(m, QuantizedKernel)]
    assert len(kernels) == 4  # qkv, o, gate_up, down of the one layer; lm_head stays float
    assert loaded.lm_head.kernel[...].dtype == jnp.float32

    rows = [{"input_ids": random_ids((1, 16), seed=i)[0]} for i in range(12)]
    runs = {}
    for name, model in (("at load", loaded), ("by the trainer", None)):
        model = model or AutoModelForCausalLM.from_pretrained(base)  # float, quantized by adopt
        trainer = Trainer(arguments=arguments(tmp_path / name), model=model, dataset_train=rows)
        runs[name] = (trainer.program.frozen_state(), trainer.train())
    (frozen_a, out_a), (frozen_b, out_b) = runs["at load"], runs["by the trainer"]
    a, b = flat(frozen_a), flat(frozen_b)
    assert a.keys() == b.keys() and any("codes" in k for k in a)
    for key in a:  # the same codes, scales, embedding and norms
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    losses = [
        [json.loads(line)["loss"] for line in (tmp_path / n / "metrics.jsonl").open() if '"loss"' in line]
        for n in runs
    ]  # fmt: skip
    assert len(losses[0]) == 3 and losses[0] == losses[1]
    for key, value in flat(out_a.state.params).items():  # the adapters trained the same
        np.testing.assert_array_equal(value, flat(out_b.state.params)[key], err_msg=key)


def test_a_quantized_base_refuses_full_fine_tuning_and_another_quantization(base, tmp_path):
    loaded = AutoModelForCausalLM.from_pretrained(base, quantization="int8")
    rows = [{"input_ids": random_ids((1, 16))[0]}] * 4
    full = arguments(tmp_path, lora_rank=0, quantization=None)
    with pytest.raises(ArgumentError, match="only LoRA adapters can train on it. Set lora_rank"):
        Trainer(arguments=full, model=loaded, dataset_train=rows)
    with pytest.raises(ArgumentError, match="loaded quantized as 'int8'"):
        Trainer(arguments=arguments(tmp_path), model=loaded, dataset_train=rows)
    with pytest.raises(ArgumentError, match="quantization='fp4'"):
        AutoModelForCausalLM.from_pretrained(base, quantization="fp4")
    with pytest.raises(
        ArgumentError,
        match="block 64 does not divide the 48 input rows of model/layers/0/mlp/down_proj",
    ):
        AutoModelForCausalLM.from_pretrained(base, quantization="nf4")


def test_the_cli_quantizes_a_pretrained_base_as_it_reads_it(base, tmp_path, capsys):
    from jaxtrain.cli.pretrained import pretrained_load_options
    from jaxtrain.cli.run_dir import build_model

    args = arguments(tmp_path, param_dtype="bfloat16")
    model = build_model(
        {"pretrained": str(base)}, None, seed=0, load_options=pretrained_load_options(args)
    )
    assert isinstance(model.model.layers[0].mlp.down_proj.kernel, QuantizedKernel)
    assert model.model.embed_tokens.embedding[...].dtype == jnp.bfloat16  # read as bfloat16

    train_file = tmp_path / "train.jsonl"
    lines = [json.dumps({"text": f"def add(a, b):\n    return a + {i}\n"}) for i in range(16)]
    train_file.write_text("\n".join(lines) + "\n")
    flags = ["--lora_rank", "4", "--quantization", "nf4", "--quantization_block_size", str(BLOCK)]
    code = main(
        ["train", "--output_dir", str(tmp_path / "run"), "--model.pretrained", str(base),
         "--data.source", "files", "--data.train_files", str(train_file), "--max_steps", "2",
         "--total_batch_size", "4", "--max_sequence_length", "16", "--progress_bar", "none",
         "--param_dtype", "bfloat16", "--sample.max_new_tokens", "2", *flags]
    )  # fmt: skip
    assert code == 0, capsys.readouterr().err
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["step"] for r in logged if "loss" in r][-1] == 2


def resident_file_kib() -> int:
    """This process's resident pages of mapped files (RssFile), in KiB."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("RssFile:"))
    return int(line.split()[1])


def test_a_quantized_load_does_not_keep_the_read_checkpoint_in_memory(tmp_path):
    """A read page of the mapped safetensors file counted in the process's memory until the
    load ended, so a QLoRA load's peak held the whole float checkpoint beside the quantized
    model (issue 49's memory bar missed by that). Each tensor's pages are released once it
    is quantized or copied: the load's peak holds about one tensor of the file."""
    import threading

    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=4096, hidden_size=256, intermediate_size=4096, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path, safe_serialization=True)
    file_kib = (tmp_path / "model.safetensors").stat().st_size // 1024
    AutoModelForCausalLM.from_pretrained(tmp_path, quantization="nf4")  # imports, compiles

    peak, done = [resident_file_kib()], threading.Event()
    start = peak[0]

    def watch() -> None:
        while not done.is_set():
            peak.append(resident_file_kib())
            done.wait(0.001)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        AutoModelForCausalLM.from_pretrained(tmp_path, quantization="nf4")
    finally:
        done.set()
        watcher.join()
    grown = max(peak) - start
    # fp32 [4096, 256]: the embedding, the head and every MLP kernel are this large
    largest_tensor_kib = 4096 * 256 * 4 // 1024
    assert file_kib > 8 * largest_tensor_kib
    assert grown < 3 * largest_tensor_kib, (grown, file_kib)
