"""`jaxtrain sample RUN` without --prompt samples from the prompt the end of `jaxtrain train`
used; a preference (DPO) row's sample starts from its own prompt."""

import datasets
from test_cli import TINY, jaxtrain
from test_first_run import word_tokenizer

from jaxtrain.data.prompts import sample_prompt


def sample_block(stdout: str) -> str:
    return stdout.split("--- sample", 1)[1].split("\n" + "-" * 61, 1)[0]


def test_sample_without_prompt_repeats_the_end_of_run_sample(tmp_path):
    run = tmp_path / "run"
    config = tmp_path / "config.yaml"  # a config file: no demo prompt, the data's own
    config.write_text("progress_bar: none\nsample: {temperature: 0.0}\n")
    trained = jaxtrain("train", str(config), "--output_dir", str(run), *TINY)
    assert trained.returncode == 0, trained.stderr[-3000:]
    sampled = jaxtrain("sample", str(run))
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    end_of_run = sample_block(trained.stdout)
    assert end_of_run.strip() and sample_block(sampled.stdout) == end_of_run
    # Bad sampling options: one line, exit 2, before the model loads (they once reached the
    # generator: a traceback, exit 1; NaN sampled garbage).
    for option, said in (("--top_p=1.5", "top_p=1.5 must be in (0, 1], e.g. --top_p 0.9."),
                         ("--temperature=nan", "temperature=nan must be >= 0"),
                         ("--max_new_tokens=0", "--max_new_tokens must be >= 1")):  # fmt: skip
        refused = jaxtrain("sample", str(run), option)
        assert refused.returncode == 2 and said in refused.stderr, refused.stderr[-2000:]
        assert len(refused.stderr.strip().splitlines()) == 1


def test_a_preference_row_is_sampled_from_its_prompt():
    tokenizer = word_tokenizer(eos_token="</s>")
    pairs = datasets.Dataset.from_list([{"prompt": "w3 w4", "chosen": "w5", "rejected": "w6"}])
    ids, text = sample_prompt(tokenizer, pairs)
    assert text == "w3 w4" and ids == [3, 4]
