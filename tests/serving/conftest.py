"""What the server tests share: a tiny Llama export (trained BPE tokenizer, chat template) and
`jaxtrain serve` started as a real process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_tiny_model(out: Path, max_positions: int) -> Path:
    """A 2-layer Llama of hidden size 32 with a 200-token BPE, saved as a Hugging Face dir."""
    import torch
    import transformers
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    text = ["def add(a, b):\n    return a + b\n", "the quick brown fox jumps\n", "import os\n"]
    bpe.train_from_iterator(text * 20, vocab_size=200, min_frequency=1,
                            special_tokens=["<s>", "</s>", "<pad>"])  # fmt: skip
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        initializer_range=0.2, bos_token_id=0, eos_token_id=1, pad_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("served"), 96)


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory) -> Path:
    """Room for requests that decode for seconds (timeouts, the queue, the drain)."""
    return write_tiny_model(tmp_path_factory.mktemp("served_long"), 1024)


@pytest.fixture(scope="session")
def free_port() -> Callable[[], int]:
    return _free_port


@pytest.fixture(scope="session")
def spawn_server() -> Callable[..., tuple[subprocess.Popen, str]]:
    """`spawn(model_dir, *options, env=...)`: a `jaxtrain serve` process answering /health,
    and its base URL (…/v1). The caller stops it. Without `--warm_up` in the options the
    server starts cold (`--warm_up false`): the warm-up of the 1024-token model compiles 88
    shapes (minutes on two busy cores), which tests of limits and routes do not need;
    test_serve_load.py and test_serve_warm.py check the warm server."""

    def spawn(model: Path, *options: str, env: dict | None = None):
        if "--warm_up" not in options:
            options = (*options, "--warm_up", "false")
        port = _free_port()
        environment = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", **(env or {})}
        process = subprocess.Popen(
            [sys.executable, "-m", "jaxtrain.cli", "serve", str(model), "--port", str(port),
             *options],
            env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    return process, f"http://127.0.0.1:{port}/v1"
            except httpx.HTTPError:
                pass
            if process.poll() is not None:
                pytest.fail(f"jaxtrain serve exited: {process.stdout.read()}")
            time.sleep(0.5)
        process.kill()
        pytest.fail("jaxtrain serve did not answer within 180 s")

    return spawn
