"""The start-up summary: printed briefly at every start, written in full to run_info.json."""

import json
import os
from importlib import metadata

import jax
from tiny_run import tiny_trainer

RULES = [["down_proj/kernel$", [None, None]]]


def test_every_start_prints_the_summary_and_run_info_holds_all_of_it(tmp_path, capsys):
    out = tmp_path / "run"
    trainer = tiny_trainer(str(out), max_steps=2, sharding_regex_rules=RULES)
    trainer.train()
    printed = capsys.readouterr()
    text = printed.out + printed.err
    lines = [line for line in text.splitlines() if line.startswith(("versions:", "jax:", "memory"))]
    assert len(lines) == 3, text  # a few lines, once
    assert f"jax {jax.__version__}" in lines[0] and "orbax " in lines[0] and "python " in lines[0]
    assert "x64 off" in lines[1] and "compilation cache" in lines[1]
    assert "GLIBC_TUNABLES " in lines[1]  # a CPU run names its malloc settings (README)
    assert "memory per device: params " in lines[2] and "parameter patterns" in lines[2]

    startup = json.loads((out / "run_info.json").read_text())["startup"]
    assert startup["versions"]["jax"] == jax.__version__
    assert startup["versions"]["orbax"] == metadata.version("orbax-checkpoint")
    settings = startup["jax_settings"]
    assert settings["XLA_FLAGS"] == os.environ.get("XLA_FLAGS", "")
    assert settings["GLIBC_TUNABLES"] == os.environ.get("GLIBC_TUNABLES", "")
    assert settings["jax_enable_x64"] is False
    assert settings["jax_compilation_cache_dir"] == jax.config.jax_compilation_cache_dir
    assert settings["xla_compiler_options"] == trainer.runtime.compiler_options
    rules = startup["partition_rules"]
    # Layers fold into one pattern each; the regex rule is named where it matched.
    assert rules["model/layers/*/mlp/down_proj/kernel"].endswith("<- regex 'down_proj/kernel$'")
    assert "logical axes" in rules["model/embed_tokens/embedding"]
    assert not any("/0/" in pattern for pattern in rules)
    memory = startup["memory_per_device_bytes"]
    assert memory["all_parameters"] == 4 * trainer.num_parameters  # float32
    assert memory["parameters"] * trainer.mesh.size >= memory["all_parameters"]
    assert memory["optimizer_state"] > 0 and memory["total"] > memory["parameters"]
    assert memory["frozen"] == 0 and "frozen" not in lines[2]  # nothing frozen: not printed

    # Not only the first start: a rerun of the finished run prints it again.
    tiny_trainer(str(out), max_steps=2, sharding_regex_rules=RULES).train()
    again = capsys.readouterr()
    assert (again.out + again.err).count("versions: jax ") == 1
