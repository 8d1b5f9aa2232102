"""Tool-calling GRPO equals TRL 1.16's on the same episodes, through both trainers' own code.

The model's turns are fixed on both sides (a script of what each rollout says at each turn,
given to TRL in place of `_generate_single_turn` and to jaxtrain in place of the engine);
everything after is each trainer's own: parsing the calls, running the tools (an unknown
tool, arguments the function does not take and a tool that raises among them), appending
their answers through the chat template, cutting the last turn at max_completion_length,
the masks, the rewards, and the loss, gradient and metrics of the update."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import datasets
import numpy as np
import pytest
import torch
import transformers
from tool_chat_fixtures import add, broken, tiny_llama, tool_tokenizer

trl = pytest.importorskip("trl")
ctu = pytest.importorskip("trl.chat_template_utils")

from test_grpo_trl_objectives import loss_grad_and_means  # noqa: E402

from jaxtrain.data.collate import IGNORE_INDEX  # noqa: E402
from jaxtrain.hf import AutoModelForCausalLM  # noqa: E402
from jaxtrain.serving import Completion  # noqa: E402
from jaxtrain.trainers import GRPOArguments, GRPOTrainer  # noqa: E402
from jaxtrain.trainers.frozen import TaskModel  # noqa: E402
from jaxtrain.trainers.grpo import grpo_objective  # noqa: E402

G, C = 2, 160  # rollouts per prompt, max_completion_length

# What rollout (row, sample) says at each of its turns ("<|im_end|>" is added to each).
SCRIPT = {
    (0, 0): ['<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>',
             "The sum is 7."],
    (0, 1): ["I think it is 8."],
    (1, 0): ['<tool_call>\n{"name": "mul", "arguments": {"a": 2}}\n</tool_call>',
             '<tool_call>\n{"name": "broken", "arguments": {"text": "x"}}\n</tool_call>',
             "Sorry."],
    (1, 1): ['<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
             '<tool_call>\n{"name": "add", "arguments": {"a": 5, "c": 1}}\n</tool_call>',
             "The first sum is 3 and the second call went wrong, so here is a long answer: "
             "the first sum is 3 and the second call went wrong, and it goes on and on"],
}  # fmt: skip
ROWS = [{"prompt": [{"role": "user", "content": f"row {r}: add the numbers"}]} for r in range(2)]


def reward(completions, completion_messages=None, **_):
    """More for longer conversations, and for saying 7: what TRL passes as `completions`
    (the messages) jaxtrain passes as `completion_messages`."""
    conversations = completions if completion_messages is None else completion_messages
    return [len(m) + 0.5 * ("7" in m[-1]["content"]) for m in conversations]


@pytest.fixture(scope="module")
def tok():
    template = ctu.qwen2_5_chat_template
    plain = PlainTokenizer(template)
    samples = [plain.apply_chat_template(r["prompt"], tools=[add, broken], tokenize=False,
                                         add_generation_prompt=True) for r in ROWS]  # fmt: skip
    samples += [text for turns in SCRIPT.values() for text in turns]
    samples += ["<tool_response>\n{'error': 'x'}\n</tool_response>", "7 3 8 TypeError"]
    out = tool_tokenizer(template, samples)
    ctu.add_response_schema(out)  # the parser both trainers read (transformers' own)
    return out


class PlainTokenizer:
    """Renders a chat template without a vocabulary (to train the BPE on its text)."""

    def __init__(self, template):
        self.inner = transformers.PreTrainedTokenizerFast(
            tokenizer_object=_whitespace(), eos_token="<|im_end|>"
        )
        self.inner.chat_template = template

    def apply_chat_template(self, *args, **kwargs):
        return self.inner.apply_chat_template(*args, **kwargs)


def _whitespace():
    from tokenizers import Tokenizer, models, pre_tokenizers

    out = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    out.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return out


@pytest.fixture(scope="module")
def checkpoint(tok, tmp_path_factory):
    return tiny_llama(tok, tmp_path_factory.mktemp("tools_trl") / "hf")


def scripted_turn(tok, ids, sample: int | None) -> list[int]:
    """The scripted next turn of the rollout whose tokens so far are `ids` (`sample`: which
    of its group, for a first turn)."""
    text = tok.decode(ids)
    row = next(r for r in range(len(ROWS)) if f"row {r}:" in text)
    turn = text.count("<|im_start|>assistant") - 1
    if sample is None:  # a later turn: the rollout is the one whose first turn this holds
        sample = next(s for s in range(G) if SCRIPT[(row, s)][0] in text)
    turns = SCRIPT[(row, sample)]
    return tok(turns[min(turn, len(turns) - 1)] + "<|im_end|>", add_special_tokens=False)[
        "input_ids"
    ]


def run_trl(tok, checkpoint, tmp_path):
    config = trl.GRPOConfig(
        output_dir=str(tmp_path / "trl"), per_device_train_batch_size=G * len(ROWS),
        num_generations=G, max_completion_length=C, use_cpu=True, report_to=[], bf16=False,
        loss_type="dapo", beta=0.0, epsilon=0.2, epsilon_high=0.2, scale_rewards="group",
        mask_truncated_completions=False, use_vllm=False, top_entropy_quantile=1.0,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, attn_implementation="eager"
    )
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=datasets.Dataset.from_list(ROWS),
        processing_class=tok,
        tools=[add, broken],
    )
    calls = iter(range(10**6))

    def generate(prompt_ids, images, fields, num_generations, has_tool_images=False):
        first = next(calls) == 0  # the first call is every rollout's first turn, in order
        # Cut at max_completion_length, as TRL's generation is (TRL cuts later turns itself).
        return [scripted_turn(tok, ids, i % G if first else None)[:C]
                for i, ids in enumerate(prompt_ids)], None  # fmt: skip

    trainer._generate_single_turn = generate
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs = trainer._generate_and_score_completions([row for row in ROWS for _ in range(G)])
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    grad = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in model.parameters()))
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if v}
    return inputs, float(loss.detach()), float(grad), metrics


class Logs:
    def __init__(self):
        self.logs = []

    def on_log(self, trainer, logs, step):
        self.logs.append(dict(logs))


def run_jaxtrain(tok, checkpoint, tmp_path):
    args = GRPOArguments(
        output_dir=str(tmp_path / "jt"), total_batch_size=G * len(ROWS), num_generations=G,
        max_prompt_length=320, max_completion_length=C, max_steps=1, learning_rate=1e-3,
        warmup_steps=0, logging_steps=1, shuffle_train=False, progress_bar="none",
        save_final=False, run_report=False, loss_type="dapo", beta=0.0, epsilon=0.2,
        rollout_warm_up=False,
    )  # fmt: skip
    logs = Logs()
    trainer = GRPOTrainer(
        arguments=args,
        model=AutoModelForCausalLM.from_pretrained(checkpoint),
        reward_funcs=[reward],
        dataset_train=ROWS,
        processing_class=tok,
        tools=[add, broken],
        callbacks=[logs],
    )
    sampler = trainer.train_source.sampler

    def sample(prompt, k, most):  # a turn cut at the tokens it may add, as the engine does
        tokens = scripted_turn(tok, prompt, k)[:most]
        return Completion(0, k or 0, list(prompt), tokens, None, "stop", [0.0] * len(tokens))

    def run(asks):  # the engine's place: each request's samples, scripted
        return [
            [sample(prompt, k if n > 1 else None, most) for k in range(n)]
            for prompt, n, _seed, most, _images in asks
        ]

    sampler.load = lambda policy: None
    sampler.run = run
    trainer.train()
    return trainer, logs.logs[0]


def test_tool_rollouts_and_update_equal_trl(tok, checkpoint, tmp_path):
    inputs, want_loss, want_grad, want = run_trl(tok, checkpoint, tmp_path)
    trainer, logged = run_jaxtrain(tok, checkpoint, tmp_path)
    batch = trainer.train_source._round.batch
    ids = np.asarray(batch["input_ids"]).reshape(G * len(ROWS), -1)
    labels = np.asarray(batch["labels"]).reshape(G * len(ROWS), -1)
    prompt_mask = inputs["prompt_mask"].numpy().astype(bool)
    completion_ids = inputs["completion_ids"].numpy()
    loss_mask = (inputs["completion_mask"] * inputs["tool_mask"]).numpy().astype(bool)
    for i in range(G * len(ROWS)):
        prompt = inputs["prompt_ids"][i].numpy()[prompt_mask[i]]
        n = int(inputs["completion_mask"][i].sum())
        p = len(prompt)
        # The same prompt (tools shown), the same tokens, the tools' answers masked alike.
        np.testing.assert_array_equal(ids[i, :p], prompt)
        np.testing.assert_array_equal(ids[i, p : p + n], completion_ids[i, :n])
        np.testing.assert_array_equal(labels[i, p : p + n] != IGNORE_INDEX, loss_mask[i, :n])
        assert (labels[i, p + n :] == IGNORE_INDEX).all()
    # Every case happened: answers appended (masked), and a last turn cut at the budget.
    assert (~loss_mask & inputs["completion_mask"].numpy().astype(bool)).sum() > 0
    assert want["completions/clipped_ratio"] > 0
    for key in ("reward", "reward_std", "frac_reward_zero_std", "tools/call_frequency",
                "tools/failure_frequency", "completions/mean_length", "completions/min_length",
                "completions/max_length", "completions/clipped_ratio"):  # fmt: skip
        np.testing.assert_allclose(logged[key], want[key], rtol=1e-5, err_msg=key)
    assert want["tools/failure_frequency"] == pytest.approx(3 / 5)  # mul, c=1, broken
    assert 0 < logged["tools/environment_token_share"] < 1
    # The update: loss, gradient norm and entropy through jaxtrain's objective on its batch.
    task = TaskModel(AutoModelForCausalLM.from_pretrained(checkpoint))
    micro = {k: v[0] for k, v in batch.items()}
    loss, grad, means = loss_grad_and_means(grpo_objective(trainer.settings), task, micro)
    assert abs(want_loss) > 1e-3  # advantages of both signs over unequal token counts
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5)
    np.testing.assert_allclose(means["entropy"], want["entropy"], rtol=1e-5)
    np.testing.assert_allclose(logged["loss"], want_loss, rtol=1e-5, atol=1e-7)
