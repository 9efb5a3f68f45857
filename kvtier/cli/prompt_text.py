"""A prompt given as text, turned into the token ids an engine would see, with the checkpoint's own tokenizer.

`text` is encoded as an engine's completions endpoint encodes a prompt (the tokenizer's special tokens
added, as `tokenizer(text)` does); `messages` are rendered with the checkpoint's chat template and the
generation prompt appended, as a chat request is. Needs `transformers` (not a kvtier dependency): without
it, or without a tokenizer in `model_dir`, a ConfigError says to give token ids instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtier.core.errors import ConfigError


def _tokenizer(model_dir: Path, where: str) -> Any:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError(
            "a prompt given as text needs the transformers package (pip install transformers) to use the "
            "checkpoint's tokenizer; or give 'tokens' / 'token_file'",
            key="text",
            source=where,
        ) from None
    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as exc:  # transformers raises OSError, ValueError, ... for a folder without a tokenizer
        raise ConfigError(
            f"cannot load the tokenizer of {model_dir}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
            "; give 'tokens' / 'token_file' instead",
            key="model_dir",
            source=where,
        ) from None


def text_tokens(model_dir: Path, text: str | None, messages: list[Any] | None, where: str) -> list[int]:
    """Token ids of `text`, or of chat `messages` rendered with the checkpoint's chat template."""
    tok = _tokenizer(model_dir, where)
    if text is not None:
        return [int(t) for t in tok(text)["input_ids"]]
    if getattr(tok, "chat_template", None) is None:
        raise ConfigError(
            f"the tokenizer of {model_dir} has no chat template: give the prompt as 'text'",
            key="messages",
            source=where,
        )
    try:
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as exc:
        raise ConfigError(
            f"cannot render the messages with the chat template: {exc}", key="messages", source=where
        ) from None
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 may answer a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]
