"""Plain UTF-8 text for language models, tokenised by byte (vocabulary 256) or by character (the text's own
sorted characters). The profile stores the vocabulary, so the job and the downloaded model share it."""
from __future__ import annotations

import numpy as np

from .common import DatasetError, ParsedDataset, decode_utf8

TOKENIZERS = ("char", "byte")
MIN_TOKENS = 200
MAX_TOKENS = 200_000_000
MAX_CHAR_VOCAB = 65_536


def parse_text(data: bytes, *, tokenizer: str | None = None, max_tokens: int = MAX_TOKENS) -> ParsedDataset:
    tokenizer = tokenizer or "char"
    if tokenizer not in TOKENIZERS:
        raise DatasetError("bad_target", f"tokenizer must be 'char' or 'byte' (got {tokenizer!r}).",
                           tokenizer=tokenizer)
    text = decode_utf8(data, fix="Save the text as UTF-8 and upload it again.")
    if tokenizer == "byte":
        ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
        vocab: list[str] | None = None
        vocab_size = 256
    else:
        vocab = sorted(set(text))
        if len(vocab) > MAX_CHAR_VOCAB:
            raise DatasetError("too_large", f"The text has {len(vocab)} distinct characters; character-level "
                               f"tokenisation allows {MAX_CHAR_VOCAB}. Use tokenizer=byte.", vocab=len(vocab))
        index = {c: i for i, c in enumerate(vocab)}
        ids = np.fromiter((index[c] for c in text), dtype=np.int64, count=len(text))
        vocab_size = len(vocab)
    if len(ids) < MIN_TOKENS:
        raise DatasetError("too_few_rows", f"The text has {len(ids)} tokens; at least {MIN_TOKENS} are needed to "
                           "train a language model and hold some out.", tokens=len(ids), minimum=MIN_TOKENS)
    if len(ids) > max_tokens:
        raise DatasetError("too_large", f"The text has {len(ids)} tokens; the limit is {max_tokens}.",
                           tokens=len(ids), limit=max_tokens)
    profile = {"format": "text", "kind": "text", "task": "language_model", "tokenizer": tokenizer,
               "vocab": vocab, "vocab_size": vocab_size, "tokens": int(len(ids)), "characters": len(text),
               "lines": text.count("\n") + (0 if text.endswith("\n") else 1)}
    return ParsedDataset(X=ids, y=None, feature_names=[], classes=[], profile=profile)


def windows(ids: np.ndarray, context: int) -> tuple[np.ndarray, np.ndarray]:
    """Non-overlapping windows of context + 1 tokens: X the first `context`, y each position's next token."""
    n = (len(ids) - 1) // context
    X = ids[: n * context].reshape(n, context)
    y = ids[1 : n * context + 1].reshape(n, context)
    return X, y


def window_count(tokens: int, context: int) -> int:
    return (tokens - 1) // context
