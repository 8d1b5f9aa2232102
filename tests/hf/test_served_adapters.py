"""Several LoRA adapters served on one base (serving/adapters.py), checked with PEFT's own
code: adapters PEFT made (random A and B, different targets) load onto jaxtrain's base, and a
batch whose rows use different adapters (or none) gives each row the logits PEFT's model with
that adapter gives; the engine decodes them together, each request token for token as
PEFT's greedy generation; the server picks the adapter by the request's `model`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_fixtures import CASES, VOCAB, hf_gpt2, hf_logits, hf_model, random_ids

peft = pytest.importorskip("peft")

from jaxtrain.errors import ArgumentError  # noqa: E402
from jaxtrain.hf import from_pretrained  # noqa: E402
from jaxtrain.serving import Engine, SamplingParams  # noqa: E402
from jaxtrain.serving.adapters import adapter_count, choose_adapters, load_adapters  # noqa: E402

TARGETS = {  # two adapters of each base: PEFT's module names, parts of fused kernels included
    "llama": (["q_proj", "v_proj"], ["k_proj", "o_proj", "gate_proj", "down_proj"]),
    "gpt2": (["c_attn"], ["c_attn", "c_proj", "c_fc"]),
}


def peft_adapters(hf, kind: str, tmp_path):
    """Two adapter directories PEFT writes, with random A and B (not PEFT's zero B)."""
    dirs = {}
    for i, targets in enumerate(TARGETS[kind]):
        torch.manual_seed(10 + i)
        config = peft.LoraConfig(r=4 + 4 * i, lora_alpha=8.0, target_modules=targets,
                                 init_lora_weights=False)  # fmt: skip
        adapted = peft.get_peft_model(hf, config)
        adapted.save_pretrained(tmp_path / f"adapter{i}")
        adapted.unload()  # PEFT adapts `hf` in place: give the plain model back
        dirs[f"adapter{i}"] = str(tmp_path / f"adapter{i}")
    return dirs


def with_adapter(hf, directory):
    return peft.PeftModel.from_pretrained(hf, directory).eval()


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def served(request, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp(request.param)
    hf = hf_gpt2(seed=2) if request.param == "gpt2" else hf_model(CASES["llama"](), seed=2)
    hf.save_pretrained(tmp_path / "base")
    dirs = peft_adapters(hf, request.param, tmp_path)
    model = from_pretrained(tmp_path / "base")
    assert load_adapters(model, dirs) == list(dirs)
    return hf, model, dirs


def test_each_row_gets_the_logits_of_peft_with_its_adapter(served):
    hf, model, dirs = served
    assert adapter_count(model) == 2
    ids = random_ids((3, 12), seed=4)
    choose_adapters(model, np.asarray([1, 0, 2], np.int32))  # rows: adapter0, base, adapter1
    ours = np.asarray(model(ids))
    choose_adapters(model, None)
    np.testing.assert_allclose(ours[1], hf_logits(hf, ids[1:2])[0], rtol=1e-4, atol=1e-4)
    for row, name in ((0, "adapter0"), (2, "adapter1")):
        peft_model = with_adapter(hf, dirs[name])
        want = hf_logits(peft_model, ids[row : row + 1])[0]
        peft_model.unload()
        assert np.abs(want - hf_logits(hf, ids[row : row + 1])[0]).max() > 1e-2  # it adapts
        np.testing.assert_allclose(ours[row], want, rtol=1e-4, atol=1e-4)


def test_the_engine_decodes_requests_of_different_adapters_together(served):
    hf, model, dirs = served
    engine = Engine(model, max_slots=4, page_size=4, max_length=32, eos_token_ids=[])
    prompt = random_ids((1, 9), seed=5)[0].tolist()
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    # The same prompt through each adapter: one batch, no prefix shared across adapters.
    ids = [engine.submit(prompt, greedy, adapter=a) for a in (0, 1, 2, 1)]
    done = {}
    while not engine.idle:
        done.update({c.request_id: c for c in engine.step()})
    for request, adapter in zip(ids, (0, 1, 2, 1)):
        reference = hf if adapter == 0 else with_adapter(hf, dirs[f"adapter{adapter - 1}"])
        with torch.no_grad():
            out = reference.generate(torch.as_tensor([prompt]), max_new_tokens=6, do_sample=False,
                                     min_new_tokens=6, pad_token_id=0)  # fmt: skip
        if adapter:
            reference.unload()
        assert done[request].token_ids == out[0, len(prompt) :].tolist(), adapter
    assert done[ids[1]].token_ids == done[ids[3]].token_ids
    assert engine.pages.available == engine.pages.num_pages - 1
    with pytest.raises(ArgumentError, match="adapter 3: this engine has 2"):
        engine.submit(prompt, greedy, adapter=3)


def test_an_adapter_that_does_not_fit_its_base_is_refused_with_its_directory(served, tmp_path):
    hf, _, dirs = served
    other = from_pretrained_other(tmp_path)
    with pytest.raises(ArgumentError, match="adapter0"):
        load_adapters(other, {"a": dirs["adapter0"]})
    with pytest.raises(ArgumentError, match="not a PEFT adapter directory"):
        load_adapters(other, {"a": str(tmp_path)})


def from_pretrained_other(tmp_path):
    """A base of other sizes (wider hidden) than the fixture's."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2)  # fmt: skip
    hf_model(config, seed=3).save_pretrained(tmp_path / "other")
    return from_pretrained(tmp_path / "other")


def test_the_server_serves_each_adapter_under_its_name(served, tmp_path):
    import socket
    import threading
    import time

    import httpx
    import uvicorn
    from hf_fixtures import tiny_tokenizer

    from jaxtrain.serving.server import create_app

    _, model, dirs = served
    engine = Engine(model, max_slots=4, page_size=4, max_length=32, eos_token_ids=[])
    prompt = random_ids((1, 9), seed=5)[0].tolist()
    want = engine.generate([prompt], SamplingParams(max_tokens=5, temperature=0.0))[0][0]
    want_a1 = engine.submit(prompt, SamplingParams(max_tokens=5, temperature=0.0), adapter=2)
    while not engine.idle:
        for c in engine.step():
            want_a1 = c.token_ids if c.request_id == want_a1 else want_a1
    app = create_app(engine, model_name="base", tokenizer=tiny_tokenizer(), adapters=list(dirs))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}/v1"
    try:
        while not server.started:
            time.sleep(0.05)
        models = httpx.get(f"{url}/models").json()["data"]
        assert [m["id"] for m in models] == ["base", "adapter0", "adapter1"]
        assert models[2]["parent"] == "base"
        body = {"prompt": prompt, "max_tokens": 5, "temperature": 0.0, "return_token_ids": True}
        for name, tokens in (("base", want.token_ids), ("adapter1", want_a1)):
            answer = httpx.post(f"{url}/completions", json={**body, "model": name}, timeout=60)
            assert answer.status_code == 200, answer.text
            assert answer.json()["model"] == name
            assert answer.json()["choices"][0]["token_ids"] == tokens
        missing = httpx.post(f"{url}/completions", json={**body, "model": "nope"}, timeout=60)
        assert missing.status_code == 404 and "'adapter1'" in missing.json()["error"]["message"]
    finally:
        server.should_exit = True
        thread.join(timeout=20)
