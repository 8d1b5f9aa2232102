"""Export to Hugging Face format: transformers loads it with the same logits, and jaxtrain
loads it back bit for bit."""

import json

import datasets
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx
from hf_fixtures import VOCAB, forward, hf_logits, random_ids, save_hf, tiny_tokenizer

from jaxtrain import Trainer, TrainingArguments
from jaxtrain.hf import AutoModelForCausalLM, HFError, save_pretrained
from jaxtrain.models import LlamaConfig, LlamaForCausalLM


def token_rows(rows: int = 32, seq: int = 16) -> datasets.Dataset:
    rng = np.random.default_rng(0)
    return datasets.Dataset.from_dict({"input_ids": rng.integers(3, VOCAB, (rows, seq)).tolist()})


def assert_same_params(a: nnx.Module, b: nnx.Module) -> None:
    flat_a = dict(nnx.to_flat_state(nnx.state(a, nnx.Param)))
    flat_b = dict(nnx.to_flat_state(nnx.state(b, nnx.Param)))
    assert flat_a.keys() == flat_b.keys()
    for path, var in flat_a.items():
        x, y = np.asarray(var[...]), np.asarray(flat_b[path][...])
        assert x.dtype == y.dtype and np.array_equal(x, y), path


def load_in_transformers(directory):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        directory, attn_implementation="eager", output_loading_info=True
    )
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    return model.eval()


def test_fine_tuned_model_round_trips_through_transformers(tmp_path):
    base = tmp_path / "base"
    save_hf("qwen2_bias", base, layers=1)  # one layer: the train step compiles faster
    tokenizer = tiny_tokenizer(base)
    model = AutoModelForCausalLM.from_pretrained(base)
    arguments = TrainingArguments(
        output_dir=str(tmp_path / "run"),
        max_steps=3,
        total_batch_size=4,
        max_sequence_length=16,
        learning_rate=1e-2,
        warmup_steps=0,
        logging_steps=1,
        progress_bar="none",
    )
    trainer = Trainer(
        arguments=arguments, model=model, dataset_train=token_rows(), processing_class=tokenizer
    )
    state = trainer.train().state
    out = trainer.save_pretrained(state, tmp_path / "export")

    trained = trainer.model_from_state(state)
    ids = random_ids((2, 16), seed=5)
    ours = np.asarray(forward(trained, jnp.asarray(ids)))
    torch_model = load_in_transformers(out)
    reference = hf_logits(torch_model, ids)
    assert np.abs(ours - reference).max() / np.abs(reference).max() < 2e-5
    # Training moved the weights: the export is the trained model, not the base one.
    base_logits = hf_logits(load_in_transformers(base), ids)
    assert np.abs(base_logits - reference).max() > 1e-3

    assert_same_params(trained, AutoModelForCausalLM.from_pretrained(out))

    # The rest of the directory: tokenizer, generation config, model card.
    reloaded = transformers.AutoTokenizer.from_pretrained(out)
    assert reloaded("def add")["input_ids"] == tokenizer("def add")["input_ids"]
    generation = json.loads((out / "generation_config.json").read_text())
    special = ("bos_token_id", "eos_token_id", "pad_token_id")
    c = model.config
    assert generation == {k: getattr(c, k) for k in special if getattr(c, k) is not None}
    transformers.GenerationConfig.from_pretrained(out)
    card = (out / "README.md").read_text()
    final_loss = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").open()][-1]["loss"]
    assert f'base_model: "{base}"' in card and "Training steps: 3" in card
    assert f"Final loss: {final_loss:.4f}" in card and '"learning_rate": 0.01' in card
    assert "Dataset, 32 rows" in card


@pytest.mark.parametrize(
    "model_type, extra",
    [
        ("llama", {"tie_word_embeddings": True, "mlp_bias": True}),
        ("mistral", {"sliding_window": 4}),
        ("qwen3", {"qk_norm": True}),
    ],
)
def test_jaxtrain_born_model_exports_sharded(tmp_path, model_type, extra):
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.2,
        model_type=model_type,
        **extra,
    )
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(1))
    out = save_pretrained(model, tmp_path, max_shard_size="16KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 2 and all((out / f).is_file() for f in files)
    ids = random_ids((2, 12), seed=3)
    reference = hf_logits(load_in_transformers(out), ids)
    ours = np.asarray(forward(model, jnp.asarray(ids)))
    assert np.abs(ours - reference).max() / np.abs(reference).max() < 2e-5
    assert_same_params(model, AutoModelForCausalLM.from_pretrained(out))
    # A second export into the same directory replaces the shards instead of mixing them.
    save_pretrained(model, tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["model.safetensors"]
    assert not (tmp_path / "model.safetensors.index.json").exists()


def test_bfloat16_export_loads_in_both_libraries(tmp_path):
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=1, num_attention_heads=4)  # fmt: skip
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    save_pretrained(model, tmp_path, dtype="bfloat16")
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    back = AutoModelForCausalLM.from_pretrained(tmp_path, param_dtype=jnp.bfloat16)
    kernel = back.lm_head.kernel[...]
    assert kernel.dtype == jnp.bfloat16
    np.testing.assert_array_equal(kernel, model.lm_head.kernel[...].astype(jnp.bfloat16))
    torch_model = load_in_transformers(tmp_path)
    assert str(torch_model.lm_head.weight.dtype) == "torch.bfloat16"


def test_export_refuses_configs_transformers_cannot_express(tmp_path):
    small = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                 num_attention_heads=4, sliding_window=8)  # fmt: skip
    # Shapes suffice: both checks run before any weight is read.
    mistral = nnx.eval_shape(
        lambda: LlamaForCausalLM(LlamaConfig(**small, model_type="mistral"), rngs=nnx.Rngs(0))
    )
    with pytest.raises(HFError, match="max_shard_size"):
        save_pretrained(mistral, tmp_path, max_shard_size="lots")
    llama = nnx.eval_shape(
        lambda: LlamaForCausalLM(LlamaConfig(**small, model_type="llama"), rngs=nnx.Rngs(0))
    )
    with pytest.raises(HFError, match="sliding_window"):  # HF Llama has no sliding window
        save_pretrained(llama, tmp_path)


def test_a_saved_tokenizer_reads_back_as_auto_tokenizer_reads_it(tmp_path):
    """load_processing_class reads jaxtrain's own tokenizers (a tokenizer.json alone) as the
    class AutoTokenizer resolves them to, without AutoTokenizer's imports (torch among them:
    3 s of every command); another class of tokenizer still goes through AutoTokenizer."""
    import subprocess
    import sys

    from jaxtrain.hf.tokenizer_files import load_processing_class, save_tokenizer

    template = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
    save_tokenizer(tiny_tokenizer(), tmp_path / "own", template)
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "own", local_files_only=True)
    ours = load_processing_class(tmp_path / "own")
    assert type(ours) is type(auto) and ours.init_kwargs == auto.init_kwargs
    assert ours.chat_template == auto.chat_template == template
    text = "def add(a, b):\n    return a + b </s><pad>"
    assert ours(text)["input_ids"] == auto(text)["input_ids"]
    assert (ours.pad_token_id, ours.eos_token_id) == (auto.pad_token_id, auto.eos_token_id)
    # Read in a process of its own: no torch.
    probe = (
        "import sys; from jaxtrain.hf.tokenizer_files import load_processing_class; "
        f"load_processing_class({str(tmp_path / 'own')!r}); print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.stdout.strip() == "False", done.stdout + done.stderr[-2000:]
    # A tokenizer of a model's own class is AutoTokenizer's to build.
    gpt2 = transformers.GPT2TokenizerFast(tokenizer_object=tiny_tokenizer().backend_tokenizer)
    gpt2.save_pretrained(tmp_path / "gpt2")
    assert (
        type(load_processing_class(tmp_path / "gpt2")).__name__
        == type(transformers.AutoTokenizer.from_pretrained(tmp_path / "gpt2")).__name__
    )
