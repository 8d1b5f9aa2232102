"""Every Python block of the README runs as written, each pasted after the blocks before it
(one namespace, in order), and the figure the ViT block claims is what it reaches.

The whole README runs shortened by one environment variable, JAXTRAIN_MAX_STEPS=1 (every run
stops after 1 update and evaluates at most 1 batch; the long-context example still trains a
32k-token row), on 8 simulated CPU devices (the mesh
examples need them); the ViT block also runs as written, unshortened, for its accuracy.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"

RUNNER = """
import json, sys
blocks = json.load(open(sys.argv[1]))
namespace = {"__name__": "__main__"}
for number, line, code in blocks:
    print(f"--- README block {number} (line {line})", flush=True)
    exec(compile(code, f"README.md:{line}", "exec"), namespace)
if "readme_result" in sys.argv[2:]:
    json.dump({k: namespace[k] for k in sys.argv[3:]}, open("readme_result.json", "w"))
"""


def python_blocks() -> list[tuple[int, int, str]]:
    """(number, first line, code) of every ```python block of the README."""
    text = README.read_text()
    blocks = []
    for number, match in enumerate(re.finditer(r"```python\n(.*?)```", text, re.S), start=1):
        line = text.count("\n", 0, match.start(1)) + 1
        blocks.append((number, line, match.group(1)))
    return blocks


def run_blocks(tmp_path: Path, blocks, env: dict[str, str], keep: tuple[str, ...] = ()) -> dict:
    (tmp_path / "blocks.json").write_text(json.dumps(blocks))
    (tmp_path / "runner.py").write_text(RUNNER)
    args = [sys.executable, "runner.py", "blocks.json"]
    if keep:
        args += ["readme_result", *keep]
    done = subprocess.run(
        args, cwd=tmp_path, env={**os.environ, **env}, capture_output=True, text=True, timeout=1500
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return json.loads((tmp_path / "readme_result.json").read_text()) if keep else {}


def test_the_readme_has_its_examples():
    # The scanner finds the blocks this file is about (a changed fence would skip them all).
    blocks = python_blocks()
    assert len(blocks) >= 12
    assert any("ViTForImageClassification" in code for _, _, code in blocks)


def test_every_python_block_of_the_readme_runs_in_order(tmp_path):
    env = {
        "JAXTRAIN_MAX_STEPS": "1",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "HF_HUB_OFFLINE": "1",
        "RAY_AUTH_MODE": "disabled",
    }
    run_blocks(tmp_path, python_blocks(), env)


def test_the_vit_block_reaches_the_accuracy_it_claims(tmp_path):
    blocks = python_blocks()
    (vit,) = [b for b in blocks if "ViTForImageClassification" in b[2]]
    claimed = re.search(r'\["eval/accuracy"\]\)\s*#\s*([0-9.]+)', vit[2])
    assert claimed, "the ViT block states the accuracy it reaches"
    imports = (0, 0, "from flax import nnx\nfrom jaxtrain import TrainingArguments\n")
    result_line = (-1, 0, 'vit_accuracy = vit_trainer.evaluate(vit_out.state)["eval/accuracy"]')
    result = run_blocks(tmp_path, [imports, vit, result_line], {}, keep=("vit_accuracy",))
    assert result["vit_accuracy"] >= 0.9
    assert abs(result["vit_accuracy"] - float(claimed.group(1))) <= 0.02, result
