"""The embedded default corpus: the running interpreter's standard library sources.

Nothing can be downloaded at run time, but the stdlib ``*.py`` files are always present (tens
of MB of real text), so the demo trains on them. A byte-level BPE tokenizer is learned from
the train split once and cached on disk; later calls only read files and load the tokenizer.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from jaxtrain.cache import cache_root
from jaxtrain.errors import ArgumentError

# datasets and transformers cost ~1 s to import; only users of the corpus pay for them.
if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerFast

__all__ = ["DefaultCorpus", "chunk_dataset", "load_default_corpus"]

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
DEFAULT_MAX_TRAIN_BYTES = 8_000_000
# Bump when the selection or tokenizer recipe changes so stale caches are never reused.
_RECIPE_VERSION = 1
_EVAL_PER_MILLE = 20  # ~2% of files go to eval
_MAX_DOC_CHARS = 32_000  # long files are split at line boundaries into pieces of about this size
# Test suites are large and repetitive; `encodings` is ~1.4 MB of generated codec tables.
_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "encodings"}
)


@dataclass(frozen=True)
class DefaultCorpus:
    """Train/eval text (one column ``"text"``) and the tokenizer learned from the train text."""

    train: datasets.Dataset
    eval: datasets.Dataset
    tokenizer: PreTrainedTokenizerFast
    train_files: tuple[str, ...]  # stdlib-relative POSIX paths, in selection order
    eval_files: tuple[str, ...]
    tokenizer_path: Path  # the cache directory the tokenizer was loaded from
    # Of the eval files' paths and text (the train text's is in tokenizer_path's name).
    eval_fingerprint: str = ""

    def token_rows(self, split: str, seq_len: int) -> datasets.Dataset:
        """`chunk_dataset` of `split` ("train" or "eval") with the corpus's own tokenizer,
        cached beside the tokenizer: the demo's 8 MB took ~10 s to encode on 2 cores, which
        every later run of the same corpus and length now reads in milliseconds."""
        import datasets

        texts = {"train": self.train, "eval": self.eval}[split]
        key = "" if split == "train" else f"-{self.eval_fingerprint}"
        path = self.tokenizer_path / f"rows-{split}-{seq_len}{key}.npy"
        if path.is_file():
            return datasets.Dataset.from_dict(
                {"input_ids": np.load(path)}, features=_row_features()
            )
        rows = chunk_dataset(texts, self.tokenizer, seq_len)
        # Written beside the target and renamed: a crash or a concurrent run never leaves half.
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".npy", delete=False) as tmp:
            try:
                np.save(tmp, np.asarray(rows.with_format("numpy")["input_ids"], np.int32))
            except BaseException:
                os.unlink(tmp.name)
                raise
        os.replace(tmp.name, path)
        return rows


def _row_features() -> datasets.Features:
    import datasets

    return datasets.Features({"input_ids": datasets.List(datasets.Value("int32"))})


def _stable_hash(salt: str, rel_path: str) -> int:
    # sha1 rather than hash(): Python's str hash is salted per process.
    return int.from_bytes(hashlib.sha1(f"{salt}:{rel_path}".encode()).digest()[:8], "big")


def _is_eval(rel_path: str) -> bool:
    return _stable_hash("split", rel_path) % 1000 < _EVAL_PER_MILLE


def _stdlib_files(root: Path) -> list[str]:
    """All stdlib ``*.py`` files (relative POSIX paths), minus skipped dirs, sorted."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        rel_dir = Path(dirpath).relative_to(root)
        found.extend((rel_dir / f).as_posix() for f in filenames if f.endswith(".py"))
    return sorted(found)


def _read_text(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None  # a few files are not UTF-8 or unreadable; they are simply not used
    return text if text.strip() else None


def _split_long(text: str, max_chars: int = _MAX_DOC_CHARS) -> list[str]:
    """Split at line boundaries so no piece much exceeds ``max_chars`` (pieces rejoin exactly)."""
    if len(text) <= max_chars:
        return [text]
    pieces, current, size = [], [], 0
    for line in text.splitlines(keepends=True):
        if current and size + len(line) > max_chars:
            pieces.append("".join(current))
            current, size = [], 0
        current.append(line)
        size += len(line)
    if current:
        pieces.append("".join(current))
    return pieces


def _select_files(
    root: Path, max_train_bytes: int
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Pick (path, text) pairs for train and eval, deterministically.

    Files are visited in an order given by a salted stable hash of their path, so the size cap
    samples the whole stdlib rather than only modules whose names start with "a". Train files
    are taken until ``max_train_bytes`` is reached; eval files met on the way are kept, and if
    none was met the walk continues to the first eval file so eval is never empty.
    """
    order = sorted(_stdlib_files(root), key=lambda rel: _stable_hash("order", rel))
    train: list[tuple[str, str]] = []
    evals: list[tuple[str, str]] = []
    train_bytes = 0
    for rel in order:
        if train_bytes >= max_train_bytes and evals:
            break
        is_eval = _is_eval(rel)
        if not is_eval and train_bytes >= max_train_bytes:
            continue  # only still looking for an eval file
        text = _read_text(root / rel)
        if text is None:
            continue
        if is_eval:
            evals.append((rel, text))
        else:
            train.append((rel, text))
            train_bytes += len(text.encode("utf-8"))
    if not train or not evals:
        raise RuntimeError(
            f"stdlib at {root} has too few readable .py files to build the default corpus "
            f"(train={len(train)}, eval={len(evals)}); pass your own dataset instead"
        )
    return train, evals


def _fingerprint(files: Sequence[tuple[str, str]]) -> str:
    digest = hashlib.sha1(f"recipe{_RECIPE_VERSION}".encode())
    for rel, text in files:
        digest.update(rel.encode())
        digest.update(b"\0")
        digest.update(text.encode("utf-8"))
        digest.update(b"\0")
    return digest.hexdigest()[:12]


def _train_tokenizer(texts: Iterator[str] | list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    from tokenizers import ByteLevelBPETokenizer, Tokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer(add_prefix_space=False)
    bpe.train_from_iterator(
        texts,
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(bpe.to_str()),  # the public way to its Tokenizer
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        # Keep decode(encode(x)) == x for source code (no " ." -> "." clean-up).
        clean_up_tokenization_spaces=False,
    )


def _load_or_train_tokenizer(
    target: Path, texts: list[str], vocab_size: int
) -> PreTrainedTokenizerFast:
    from transformers import PreTrainedTokenizerFast

    if (target / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(str(target))
    tokenizer = _train_tokenizer(texts, vocab_size)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write beside the target and rename: a crash leaves only a temp dir, never half a tokenizer.
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache may be shared
        tokenizer.save_pretrained(str(tmp))
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process won the race; its (identical) tokenizer is already in place.
            if not (target / "tokenizer.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return PreTrainedTokenizerFast.from_pretrained(str(target))


def _documents(files: Sequence[tuple[str, str]]) -> list[str]:
    return [piece for _, text in files for piece in _split_long(text)]


def load_default_corpus(
    *,
    vocab_size: int = 4096,
    max_train_bytes: int = DEFAULT_MAX_TRAIN_BYTES,
    cache_dir: str | os.PathLike[str] | None = None,
) -> DefaultCorpus:
    """Build the stdlib corpus and its BPE tokenizer (trained once, then loaded from cache).

    Args:
      vocab_size: BPE vocabulary size, including the two special tokens.
      max_train_bytes: cap on the UTF-8 bytes of train text (eval adds about 2% on top).
      cache_dir: where tokenizers are cached; default ``$JAXTRAIN_CACHE`` or
        ``~/.cache/jaxtrain``. The key includes the vocab size, the Python version, the cap
        and a fingerprint of the selected text.
    """
    # ArgumentError is a ValueError: callers that caught the built-in keep working.
    if vocab_size < 258:
        raise ArgumentError(
            f"vocab_size={vocab_size} is too small: a byte-level BPE needs 256 byte tokens "
            "plus 2 special tokens; use vocab_size >= 258 (default 4096)"
        )
    if max_train_bytes <= 0:
        raise ArgumentError(f"max_train_bytes must be > 0, got {max_train_bytes}")
    root = Path(sysconfig.get_paths()["stdlib"])
    train_files, eval_files = _select_files(root, max_train_bytes)
    train_docs, eval_docs = _documents(train_files), _documents(eval_files)

    py = "{}.{}.{}".format(*sys.version_info[:3])
    key = f"stdlib-bpe-v{vocab_size}-py{py}-cap{max_train_bytes}-{_fingerprint(train_files)}"
    target = Path(cache_dir) if cache_dir is not None else cache_root()
    tokenizer = _load_or_train_tokenizer(target / key, train_docs, vocab_size)

    import datasets

    return DefaultCorpus(
        train=datasets.Dataset.from_dict({"text": train_docs}),
        eval=datasets.Dataset.from_dict({"text": eval_docs}),
        tokenizer=tokenizer,
        train_files=tuple(rel for rel, _ in train_files),
        eval_files=tuple(rel for rel, _ in eval_files),
        tokenizer_path=target / key,
        eval_fingerprint=_fingerprint(eval_files),
    )


def _encode_batch(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> list[list[int]]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "encode_batch_fast"):
        # Rust, in parallel, and ~3x faster than __call__ because it skips char offsets.
        return [enc.ids for enc in backend.encode_batch_fast(texts, add_special_tokens=False)]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def chunk_dataset(
    dataset: datasets.Dataset | Sequence[dict],
    tokenizer: PreTrainedTokenizerFast,
    seq_len: int,
    *,
    text_column: str = "text",
    add_eos: bool = True,
    batch_size: int = 1000,
) -> datasets.Dataset:
    """GPT-style chunking: tokenize every document, append eos, concatenate, cut into rows.

    Returns a Dataset with one column ``"input_ids"`` whose rows hold exactly ``seq_len``
    tokens; the tail that does not fill a row is dropped. No bos or other special tokens
    are added besides the eos separator.
    """
    import datasets

    if seq_len <= 0:
        raise ValueError(f"seq_len must be > 0, got {seq_len}")
    columns = dataset.column_names if isinstance(dataset, datasets.Dataset) else None
    if columns is not None and text_column not in columns:
        raise ValueError(
            f"chunk_dataset: text_column={text_column!r} not found; available columns: {columns}"
        )
    eos_id = tokenizer.eos_token_id
    if add_eos and eos_id is None:
        raise ValueError("chunk_dataset: add_eos=True but the tokenizer has no eos_token; set one")

    n = len(dataset)
    parts: list[np.ndarray] = []
    for start in range(0, n, batch_size):
        if columns is not None:
            texts = dataset[start : start + batch_size][text_column]
        else:
            texts = [row[text_column] for row in dataset[start : start + batch_size]]
        for offset, text in enumerate(texts):
            if not isinstance(text, str):
                raise ValueError(
                    f"chunk_dataset: row {start + offset} column {text_column!r} is "
                    f"{type(text).__name__}, expected str"
                )
        for ids in _encode_batch(tokenizer, texts):
            parts.append(np.asarray(ids, dtype=np.int32))
            if add_eos:
                parts.append(np.asarray([eos_id], dtype=np.int32))
    flat = np.concatenate(parts) if parts else np.zeros((0,), np.int32)
    rows = len(flat) // seq_len
    table = flat[: rows * seq_len].reshape(rows, seq_len)
    return datasets.Dataset.from_dict({"input_ids": table}, features=_row_features())
