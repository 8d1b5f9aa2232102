"""JAX's persistent compilation cache under $JAXTRAIN_CACHE/xla: real processes, so each run
starts with an empty in-memory cache, as a rerun or a resume does."""

import os
import subprocess
import sys
from pathlib import Path

RUN = """
import sys
from flax import nnx
from jaxtrain import Trainer, TrainingArguments
from jaxtrain.models import LlamaConfig, LlamaForCausalLM

setting = None if sys.argv[2] == "off" else sys.argv[2]
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1)
args = TrainingArguments(output_dir=sys.argv[1], max_steps=2, total_batch_size=4,
                         max_sequence_length=16, warmup_steps=0, evaluation_strategy="no",
                         save_final=False, progress_bar="none", run_report=False,
                         overwrite_output_dir=True, compilation_cache_dir=setting)
rows = [{"input_ids": list(range(1, 17))}] * 8
Trainer(arguments=args, model=LlamaForCausalLM(config, rngs=nnx.Rngs(0)), dataset_train=rows).train()
"""


ZSTD_MAGIC = bytes.fromhex("28b52ffd")


def train(tmp_path: Path, setting: str, **env: str) -> None:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION")}
    environ.update(JAX_PLATFORMS="cpu", JAXTRAIN_CACHE=str(tmp_path / "cache"), **env)
    # Every program is kept, however fast it compiled (JAX's default threshold is 1 s).
    environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    result = subprocess.run(
        [sys.executable, "-c", RUN, str(tmp_path / "run"), setting],
        capture_output=True, text=True, env=environ, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]


def entries(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()} if directory.is_dir() else set()


def test_a_rerun_loads_its_programs_from_the_cache_and_adds_none(tmp_path):
    train(tmp_path, "auto")
    first = entries(tmp_path / "cache" / "xla")
    assert any("train_step" in name for name in first), first
    # zstandard is a dependency so that JAX stores programs with zstd (with zlib otherwise:
    # 8x slower to write the suite's programs). A zstd frame starts with its magic number.
    stored = [tmp_path / "cache" / "xla" / name for name in first if name.endswith("-cache")]
    assert stored and all(p.read_bytes()[:4] == ZSTD_MAGIC for p in stored), stored
    train(tmp_path, "auto")
    assert entries(tmp_path / "cache" / "xla") == first  # every program was found


def test_the_cache_can_be_turned_off_and_jaxs_own_setting_wins(tmp_path):
    train(tmp_path, "off")
    assert not (tmp_path / "cache" / "xla").exists()
    own = tmp_path / "own"
    train(tmp_path, "auto", JAX_COMPILATION_CACHE_DIR=str(own))
    assert entries(own) and not (tmp_path / "cache" / "xla").exists()
