"""The tokenizer files of an exported directory, with the chat template the run trained with.

`TrainingArguments.chat_template` renders the training conversations in place of the
tokenizer's own template; it lives in the run's arguments, not in the tokenizer, so a plain
`tokenizer.save_pretrained` would export the tokenizer's template (or none) and chat
inference would format prompts differently from training. transformers itself writes the
template (chat_template.jinja in current versions), so `AutoTokenizer.from_pretrained` reads
it back the way it reads any model's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def save_tokenizer(tokenizer: Any, save_directory: str | Path, chat_template: str | None) -> None:
    """`tokenizer.save_pretrained(save_directory)` with `chat_template` (when given) as its
    template; the caller's tokenizer is left as it was."""
    if tokenizer is None or not hasattr(tokenizer, "save_pretrained"):
        return
    if chat_template is None:
        tokenizer.save_pretrained(str(save_directory))
        return
    own = getattr(tokenizer, "chat_template", None)
    tokenizer.chat_template = chat_template
    try:
        tokenizer.save_pretrained(str(save_directory))
    finally:
        tokenizer.chat_template = own


# An image processor's config beside the tokenizer: the directory holds a multimodal processor.
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def load_processing_class(directory: str | Path) -> Any:
    """The tokenizer saved in `directory` or, where an image processor was saved with it (a
    vision-language model's), the whole processor (`AutoProcessor`: tokenizer, chat template
    and image processor, on its PIL path)."""
    directory = Path(directory)
    # Imported only where needed: transformers' processor module imports torch (3 s of every
    # command that reads a text model's tokenizer).
    if any((directory / name).is_file() for name in PROCESSOR_FILES):
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(str(directory), local_files_only=True)
    if (
        _tokenizer_class(directory) in PLAIN_FAST_TOKENIZERS
        and (directory / "tokenizer.json").is_file()
    ):
        # What AutoTokenizer resolves these to, without its imports (torch among them):
        # 1 s instead of 3.6 for every command that reads jaxtrain's own tokenizer.
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(directory), local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


# The tokenizer classes a tokenizer.json alone defines (transformers 5 names the class
# TokenizersBackend, 4.x PreTrainedTokenizerFast): jaxtrain's own tokenizers save as these.
PLAIN_FAST_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _tokenizer_class(directory: Path) -> str | None:
    config = directory / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        return json.loads(config.read_text()).get("tokenizer_class")
    except (ValueError, AttributeError):
        return None  # AutoTokenizer reads it and says what is wrong
