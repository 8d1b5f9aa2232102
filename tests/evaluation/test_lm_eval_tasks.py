"""lm-eval tasks during training and after it, held equal to lm-eval's own Hugging Face
backend (HFLM through transformers) on the same exported checkpoint and the same local tasks.

One small run (module fixture) trains a tiny Llama on the embedded corpus's tokenizer with
eval_tasks, and exports its final state. Its context is 48 tokens, so lm-eval's edge rules
are exercised: contexts and continuations truncated from the left, generation contexts cut to
make room for max_gen_toks, rolling log-likelihoods over several windows.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from flax import nnx

from jaxtrain import Trainer, TrainingArguments
from jaxtrain.cli import main
from jaxtrain.data import chunk_dataset, load_default_corpus
from jaxtrain.errors import TaskError
from jaxtrain.evaluation import EXAMPLES
from jaxtrain.evaluation.harness import TaskSuite, flatten_results
from jaxtrain.models import LlamaConfig, LlamaForCausalLM
from jaxtrain.observability.logs import read_jsonl
from jaxtrain.observability.report import write_report

# A rolling log-likelihood (perplexity) task over the same lines, each a few windows long.
ROLLING = f"""
task: python_lines_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {EXAMPLES / "python_em.jsonl"}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{prefix}}}}{{{{rest}}}}{{{{prefix}}}}{{{{rest}}}}"
"""


@pytest.fixture(scope="module")
def corpus():
    return load_default_corpus(max_train_bytes=200_000, vocab_size=384)


def tiny_model(tokenizer) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=48,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    return LlamaForCausalLM(config, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def run(tmp_path_factory, corpus):
    """A run scoring three tasks at steps 4 and 8, and its final state exported."""
    root = tmp_path_factory.mktemp("tasks")
    rolling = root / "rolling.yaml"
    rolling.write_text(ROLLING)
    tasks = ["python_mc", "python_em", str(rolling)]
    args = TrainingArguments(
        output_dir=str(root / "run"), max_steps=8, total_batch_size=8, max_sequence_length=32,
        learning_rate=3e-3, warmup_steps=1, logging_steps=4, eval_steps=4, progress_bar="none",
        eval_tasks=tasks, eval_batch_size=8,
    )  # fmt: skip
    trainer = Trainer(
        arguments=args,
        model=tiny_model(corpus.tokenizer),
        dataset_train=chunk_dataset(corpus.train, corpus.tokenizer, 32),
        processing_class=corpus.tokenizer,
    )
    output = trainer.train()
    export = trainer.save_pretrained(output.state, root / "export")
    return {"root": root, "tasks": tasks, "output": output, "export": export}


def test_scores_are_logged_at_every_evaluation_with_their_stderr(run):
    records = [
        r for r in read_jsonl(run["root"] / "run" / "metrics.jsonl") if "eval/python_mc/acc" in r
    ]
    assert [r["step"] for r in records] == [4, 8]
    for record in records:
        for key in ("python_mc/acc", "python_mc/acc_norm", "python_em/exact_match"):
            assert 0 <= record[f"eval/{key}"] <= 1 and f"eval/{key}_stderr" in record
        assert record["eval/python_lines_ppl/bits_per_byte"] > 0
    assert run["output"].metrics["eval/python_mc/acc"] == records[-1]["eval/python_mc/acc"]
    # The report shows the final scores.
    summary = dict(write_report(run["root"] / "run").summary)
    assert summary["python_mc acc"] == f"{records[-1]['eval/python_mc/acc']:.3f} ± " + (
        f"{records[-1]['eval/python_mc/acc_stderr']:.3f}"
    )


@pytest.fixture(scope="module")
def scored(run):
    """The export scored by jaxtrain (JaxLM) and by lm-eval's HFLM, every sample kept."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    from jaxtrain.evaluation.lm import JaxLM
    from jaxtrain.hf import AutoModelForCausalLM

    suite = TaskSuite(run["tasks"])
    export = run["export"]
    lm = JaxLM(AutoModelForCausalLM.from_pretrained(export), AutoTokenizer.from_pretrained(export),
               batch_size=8)  # fmt: skip
    ours = suite.evaluate(lm, samples=True)
    reference = simple_evaluate(
        model=HFLM(pretrained=str(export), device="cpu", batch_size=8),
        tasks=[spec.config for spec in suite.specs],
        task_manager=TaskManager(include_defaults=False),
        log_samples=True,
    )
    return ours, reference


def test_scores_equal_lm_eval_s_hugging_face_backend(scored):
    ours, reference = scored
    expected = flatten_results(reference)
    for key in ("python_mc/acc", "python_mc/acc_norm", "python_em/exact_match"):
        assert ours[f"eval/{key}"] == expected[f"eval/{key}"], key
    for key in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        np.testing.assert_allclose(
            ours[f"eval/python_lines_ppl/{key}"],
            expected[f"eval/python_lines_ppl/{key}"],
            rtol=1e-4,
        )


def test_every_request_equals_hflm_s(scored):
    """Each loglikelihood within 1e-4 relative (and the same greedy flag), each rolling
    log-likelihood likewise, each generation the same text."""
    ours, reference = scored
    lengths = []
    for task in ("python_mc", "python_em", "python_lines_ppl"):
        mine, theirs = ours["lm_eval"]["samples"][task], reference["samples"][task]
        assert len(mine) == len(theirs) == 40
        for a, b in zip(mine, theirs, strict=True):
            assert a["doc_id"] == b["doc_id"] and a["arguments"] == b["arguments"]
            for (got,), (want,) in zip(a["resps"], b["resps"], strict=True):
                if task == "python_mc":
                    assert abs(got[0] - want[0]) <= 1e-4 * abs(want[0]), (got, want)
                    assert got[1] == want[1]
                elif task == "python_lines_ppl":
                    assert abs(got - want) <= 1e-4 * abs(want), (got, want)
                else:
                    assert got == want, a["doc"]
                    lengths.append(len(got))
    assert max(lengths) > 0  # something was generated (and cut at the line's end)


def test_in_training_scores_equal_the_exported_model_s(run, scored):
    ours, _ = scored
    logged = run["output"].metrics
    for key in ("python_mc/acc", "python_mc/acc_norm", "python_em/exact_match"):
        assert logged[f"eval/{key}"] == ours[f"eval/{key}"]
    np.testing.assert_allclose(
        logged["eval/python_lines_ppl/word_perplexity"],
        ours["eval/python_lines_ppl/word_perplexity"],
        rtol=1e-5,
    )


def test_jaxtrain_evaluate_scores_an_export_and_writes_lm_eval_s_results(run, scored, capsys):
    ours, _ = scored
    out = run["root"] / "results.json"
    assert main(["evaluate", str(run["export"]), "--tasks", "python_mc", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    acc = ours["eval/python_mc/acc"]
    assert f"python_mc                acc                        {acc:.4f}" in printed
    results = json.loads(out.read_text())
    assert results["results"]["python_mc"]["acc,none"] == acc


def test_a_bad_task_fails_before_training(run, corpus, tmp_path):
    (tmp_path / "task.yaml").write_text(
        (EXAMPLES / "python_mc.yaml").read_text().replace("python_mc.jsonl", "gone.jsonl")
    )
    args = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=2, progress_bar="none",
                             eval_tasks=[str(tmp_path / "task.yaml")])  # fmt: skip
    with pytest.raises(TaskError, match="data file 'gone.jsonl' does not exist"):
        Trainer(arguments=args, model=tiny_model(corpus.tokenizer), dataset_train=[{"input_ids": [1, 2]}],
                processing_class=corpus.tokenizer)  # fmt: skip
    assert not (tmp_path / "run").exists()
    with pytest.raises(TaskError, match="pass the tokenizer"):
        Trainer(arguments=args.__class__(output_dir=str(tmp_path / "run"), eval_tasks=["python_mc"]),
                model=tiny_model(corpus.tokenizer))  # fmt: skip
    assert main(["evaluate", str(run["export"]), "--tasks", str(tmp_path / "task.yaml")]) == 2
