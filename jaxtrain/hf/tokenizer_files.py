"""The tokenizer files of an exported directory, with the chat template the run trained with.

`TrainingArguments.chat_template` renders the training conversations in place of the
tokenizer's own template; it lives in the run's arguments, not in the tokenizer, so a plain
`tokenizer.save_pretrained` would export the tokenizer's template (or none) and chat
inference would format prompts differently from training. transformers itself writes the
template (chat_template.jinja in current versions), so `AutoTokenizer.from_pretrained` reads
it back the way it reads any model's.
"""

from __future__ import annotations

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
    from transformers import AutoProcessor, AutoTokenizer

    directory = Path(directory)
    if any((directory / name).is_file() for name in PROCESSOR_FILES):
        return AutoProcessor.from_pretrained(str(directory), local_files_only=True)
    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
