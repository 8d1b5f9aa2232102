"""`jaxtrain serve` of a vision-language model (Gemma 3), called with the `openai` client:
a chat message with an image as a data URL gets the tokens `generate` gives with that image,
a chat without images is answered too, and a URL the server would have to fetch, an unreadable
image or an image sent to a text model is a 400 (issue 50)."""

from __future__ import annotations

import base64
import io
import sys
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

sys.path.insert(0, str(Path(__file__).parents[1]))
from vlm_fixtures import picture, write_checkpoint  # noqa: E402

from jaxtrain.hf import AutoModelForCausalLM, load_tokenizer  # noqa: E402
from jaxtrain.models import generate  # noqa: E402
from jaxtrain.serving.openai_api import RequestError, parse_request  # noqa: E402

NEW = 5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("served_vlm") / "base", seed=7)


@pytest.fixture(scope="module")
def client(checkpoint, spawn_server):
    process, base = spawn_server(checkpoint, "--max_slots", "2", "--model_name", "vlm",
                                 "--max_images", "2", "--max_length", "64")  # fmt: skip
    yield openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
    process.terminate()
    process.wait(timeout=30)


def data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def ask(client, content, **extra):
    return client.chat.completions.create(
        model="vlm", messages=[{"role": "user", "content": content}], max_tokens=NEW,
        temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True, **extra},
    )  # fmt: skip


def test_a_chat_with_an_image_gives_generates_tokens(checkpoint, client):
    processor = load_tokenizer(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint))
    image = picture(4, 30, 50)
    content = [{"type": "text", "text": "describe this image"},
               {"type": "image_url", "image_url": {"url": data_url(image)}}]  # fmt: skip
    out = ask(client, content)
    # The same prompt rendered here: the image part where the client put it.
    messages = [{"role": "user", "content": [{"type": "text", "text": "describe this image"},
                                             {"type": "image"}]}]  # fmt: skip
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=[[image]], return_tensors="np", add_special_tokens=False)
    expected = generate(model, inputs["input_ids"], max_new_tokens=NEW,
                        pixel_values=inputs["pixel_values"][None])[0]  # fmt: skip
    assert out.choices[0].model_extra["token_ids"] == expected.tolist()
    assert out.usage.prompt_tokens == inputs["input_ids"].shape[1]
    plain = ask(client, "what is a square")  # no image: the processor renders it too
    assert len(plain.choices[0].model_extra["token_ids"]) == NEW


def test_bad_images_are_400s(client, checkpoint):
    fetched = [{"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]
    with pytest.raises(openai.BadRequestError, match="must be a data URL"):
        ask(client, fetched)
    broken = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    with pytest.raises(openai.BadRequestError, match="cannot be read"):
        ask(client, broken)
    too_many = [{"type": "image_url", "image_url": {"url": data_url(picture(i))}} for i in range(3)]
    with pytest.raises(openai.BadRequestError, match="at most max_images=2"):
        ask(client, too_many)
    # A text model's server: an image part is refused before anything runs.
    body = {"model": "m", "messages": [{"role": "user", "content": broken}]}
    with pytest.raises(RequestError, match="takes no images") as err:
        parse_request(body, chat=True, model_name="m", tokenizer=load_tokenizer(checkpoint).tokenizer,
                      max_length=64)  # fmt: skip
    assert err.value.status == 400
