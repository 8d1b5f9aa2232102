"""The embedded stdlib corpus: split, cap, cache and chunking (small sizes keep it fast)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from transformers import PreTrainedTokenizerFast

from jaxtrain.data import DefaultCorpus, chunk_dataset, load_default_corpus
from jaxtrain.data import corpus as corpus_mod

SMALL = dict(vocab_size=512, max_train_bytes=300_000)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tok-cache")


@pytest.fixture(scope="module")
def built(cache_dir):
    start = time.perf_counter()
    corpus = load_default_corpus(**SMALL, cache_dir=cache_dir)
    return corpus, time.perf_counter() - start


@pytest.fixture(scope="module")
def corpus(built) -> DefaultCorpus:
    return built[0]


def test_split_is_disjoint_nonempty_and_hash_based(corpus):
    assert len(corpus.train) > 0 and len(corpus.eval) > 0
    assert not set(corpus.train_files) & set(corpus.eval_files)
    assert all(corpus_mod._is_eval(f) for f in corpus.eval_files)
    assert not any(corpus_mod._is_eval(f) for f in corpus.train_files)
    assert corpus.train.column_names == ["text"] and corpus.eval.column_names == ["text"]
    train_texts = set(corpus.train["text"])
    assert not any(t in train_texts for t in corpus.eval["text"])


def test_selection_skips_site_packages_and_tests(corpus):
    for rel in corpus.train_files + corpus.eval_files:
        parts = rel.split("/")
        assert "site-packages" not in parts and "test" not in parts, rel
        assert rel.endswith(".py")


def test_cap_respected_and_deterministic(corpus, tmp_path):
    train_bytes = sum(len(t.encode()) for t in corpus.train["text"])
    # The cap is reached by the last file taken, not overshot by more than that file.
    last = corpus.train_files[-1]
    root = corpus_mod.Path(corpus_mod.sysconfig.get_paths()["stdlib"])
    last_bytes = len((root / last).read_text(encoding="utf-8").encode())
    assert SMALL["max_train_bytes"] <= train_bytes < SMALL["max_train_bytes"] + last_bytes
    # A fresh build (other cache dir) selects the same files and text in the same order.
    again = load_default_corpus(**SMALL, cache_dir=tmp_path)
    assert again.train_files == corpus.train_files
    assert again.eval_files == corpus.eval_files
    assert again.train["text"][:] == corpus.train["text"][:]
    # A bigger cap extends the same ordering (a prefix), so small demos are subsets of big ones.
    train_big, _ = corpus_mod._select_files(root, 600_000)
    assert tuple(rel for rel, _ in train_big[: len(corpus.train_files)]) == corpus.train_files


def test_long_files_split_at_line_boundaries():
    text = "".join(f"line {i} " + "x" * (i % 50) + "\n" for i in range(3000))
    pieces = corpus_mod._split_long(text, max_chars=5000)
    assert len(pieces) > 1
    assert "".join(pieces) == text
    assert all(p.endswith("\n") and len(p) <= 5000 for p in pieces)


def test_tokenizer_type_special_tokens_and_round_trip(corpus):
    tok = corpus.tokenizer
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert tok.eos_token == "<|endoftext|>" and tok.bos_token == "<|endoftext|>"
    assert tok.pad_token == "<|pad|>"
    assert tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id
    assert len(tok) == SMALL["vocab_size"]
    snippet = corpus.eval["text"][0][:4000] + "\n\tx = 'é ☃ 日本'  ,  .  \r\n"
    ids = tok(snippet, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == snippet
    # Even 256 learned merges compress source code clearly below one token per byte.
    assert len(ids) < 0.8 * len(snippet.encode())


def test_second_load_hits_cache(built, cache_dir):
    corpus, cold_s = built
    entries = [p.name for p in cache_dir.iterdir()]
    assert entries == [corpus.tokenizer_path.name]  # no temp dirs left behind
    assert (corpus.tokenizer_path / "tokenizer.json").is_file()
    mtime = (corpus.tokenizer_path / "tokenizer.json").stat().st_mtime_ns
    start = time.perf_counter()
    warm = load_default_corpus(**SMALL, cache_dir=cache_dir)
    warm_s = time.perf_counter() - start
    assert (corpus.tokenizer_path / "tokenizer.json").stat().st_mtime_ns == mtime  # not rewritten
    assert warm.tokenizer.get_vocab() == corpus.tokenizer.get_vocab()
    assert warm_s < 1.0
    assert "py" in corpus.tokenizer_path.name and "v512" in corpus.tokenizer_path.name


def test_failed_save_leaves_no_partial_tokenizer(tmp_path, monkeypatch):
    def broken_save(self, *args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", broken_save)
    with pytest.raises(OSError, match="disk full"):
        load_default_corpus(**SMALL, cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    ok = load_default_corpus(**SMALL, cache_dir=tmp_path)
    assert (ok.tokenizer_path / "tokenizer.json").is_file()


def test_chunk_rows_are_exact_slices_of_the_concatenated_stream(corpus):
    tok, seq_len = corpus.tokenizer, 64
    chunks = chunk_dataset(corpus.eval, tok, seq_len)
    assert chunks.column_names == ["input_ids"]
    rows = np.asarray(chunks["input_ids"][:], dtype=np.int64)
    assert rows.ndim == 2 and rows.shape[1] == seq_len and len(rows) > 0
    stream = []
    for text in corpus.eval["text"]:
        stream += tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert len(stream) // seq_len == len(rows)
    np.testing.assert_array_equal(rows.reshape(-1), stream[: len(rows) * seq_len])


@pytest.mark.parametrize("split", ["train", "eval"])
def test_token_rows_are_the_chunks_and_a_second_call_reads_them(corpus, split):
    text = {"train": corpus.train, "eval": corpus.eval}[split]
    want = np.asarray(chunk_dataset(text, corpus.tokenizer, 48)["input_ids"][:])
    first = corpus.token_rows(split, 48)
    (cached,) = corpus.tokenizer_path.glob(f"rows-{split}-48*.npy")
    np.save(cached, np.load(cached)[:2])  # what a second call returns comes from the file
    second = corpus.token_rows(split, 48)
    np.testing.assert_array_equal(np.asarray(first["input_ids"][:]), want)
    np.testing.assert_array_equal(np.asarray(second["input_ids"][:]), want[:2])
    assert first.features == second.features
    assert len(corpus.token_rows(split, 16)[0]["input_ids"]) == 16  # a length: its own rows
    assert not list(corpus.tokenizer_path.glob("tmp*"))  # no temporary file left


def test_chunk_without_eos_and_from_list(corpus):
    tok = corpus.tokenizer
    docs = [{"body": "def f(x):\n    return x\n"}, {"body": "print('hi')\n"}]
    chunks = chunk_dataset(docs, tok, 4, text_column="body", add_eos=False)
    stream = [i for d in docs for i in tok(d["body"], add_special_tokens=False)["input_ids"]]
    flat = [i for row in chunks["input_ids"] for i in row]
    assert flat == stream[: len(flat)] and len(stream) - len(flat) < 4
    assert tok.eos_token_id not in flat


def test_bad_arguments_name_the_field(corpus):
    with pytest.raises(ValueError, match="vocab_size"):
        load_default_corpus(vocab_size=100)
    with pytest.raises(ValueError, match="'content'.*available columns"):
        chunk_dataset(corpus.eval, corpus.tokenizer, 8, text_column="content")
    with pytest.raises(ValueError, match="row 1"):
        chunk_dataset([{"text": "a"}, {"text": 3}], corpus.tokenizer, 8)
