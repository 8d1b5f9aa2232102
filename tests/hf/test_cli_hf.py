"""`jaxtrain train --model.pretrained DIR` and `jaxtrain export` through the CLI entry point."""

import json

import numpy as np
import transformers
import yaml
from hf_fixtures import forward, hf_logits, random_ids, save_hf, tiny_tokenizer

from jaxtrain.cli import main
from jaxtrain.models import LlamaForCausalLM

TINY = [
    "--max_steps", "2",
    "--total_batch_size", "4",
    "--max_sequence_length", "16",
    "--warmup_steps", "0",
    "--logging_steps", "1",
    "--learning_rate", "1e-2",
    "--progress_bar", "none",
    "--sample.max_new_tokens", "2",
]  # fmt: skip


def test_fine_tune_a_local_hf_model_then_export_it(tmp_path, capsys):
    base = tmp_path / "base"
    save_hf("llama_tied", base, layers=1)  # one layer: the train step compiles faster
    tiny_tokenizer(base)
    train_file = tmp_path / "train.jsonl"
    lines = [json.dumps({"text": f"def add(a, b):\n    return a + {i}\n"}) for i in range(16)]
    train_file.write_text("\n".join(lines) + "\n")
    run = tmp_path / "run"
    code = main(
        ["train", "--output_dir", str(run), "--model.pretrained", str(base),
         "--data.source", "files", "--data.train_files", str(train_file), *TINY]
    )  # fmt: skip
    printed = capsys.readouterr()
    assert code == 0, printed.err
    # No demo settings under a pretrained model, and the sample continues the run's own data
    # (the first half of its first row), not the demo's "def " prompt.
    assert "config from demo" not in printed.out
    assert "--- sample" in printed.out and "def add(a" in printed.out.split("--- sample")[1]
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["model"]["base_model"] == str(base) and saved["model"]["tie_word_embeddings"]
    assert saved["data"]["tokenizer"] == str(base)  # the model's own tokenizer was used

    out = tmp_path / "export"
    assert main(["export", str(run), str(out)]) == 0
    assert "exported" in capsys.readouterr().out
    card = (out / "README.md").read_text()
    assert f'base_model: "{base}"' in card and "Training steps: 2" in card
    assert "Final loss:" in card and "train_files=" in card
    assert (out / "tokenizer.json").is_file()

    ids = random_ids((2, 12), seed=4)
    exported = LlamaForCausalLM.from_pretrained(out)
    torch_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    reference = hf_logits(torch_model, ids)
    ours = np.asarray(forward(exported, ids))
    assert np.abs(ours - reference).max() / np.abs(reference).max() < 2e-5
    base_model = LlamaForCausalLM.from_pretrained(base)
    assert np.abs(np.asarray(forward(base_model, ids)) - ours).max() > 1e-3  # it trained

    # A checkpoint step directory works too, with a dtype for the files.
    out16 = tmp_path / "export16"
    assert main(["export", str(run / "checkpoints" / "2"), str(out16), "--dtype", "bfloat16"]) == 0
    assert json.loads((out16 / "config.json").read_text())["dtype"] == "bfloat16"


def test_cli_bad_input_exits_2_with_the_reason(tmp_path, capsys):
    assert main(["export", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "neither a run directory" in capsys.readouterr().err
    assert main(["export", str(tmp_path)]) == 2
    assert "OUT_DIR" in capsys.readouterr().err
    code = main(["train", "--output_dir", str(tmp_path / "r"), "--model.pretrained",
                 "jaxtrain-tests/no-such-model", *TINY])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err
    assert "does not download" in err and "Traceback" not in err
    base = tmp_path / "base"
    save_hf("llama", base)
    code = main(["train", "--output_dir", str(tmp_path / "r"), "--model.pretrained", str(base),
                 "--model.hidden_size", "64", *TINY])  # fmt: skip
    assert code == 2 and "model.hidden_size" in capsys.readouterr().err
