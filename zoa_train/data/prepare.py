"""One call from a data config to a tokenizer and both splits' token files.

Everything lands under one cache directory, keyed by content, so the first run (or the first
rank) pays for tokenizer training and tokenization and every later run or rank only maps files.
"""

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from zoa_train.data.shards import load_or_build_tokens
from zoa_train.data.sources import TextSource, iter_texts, source_fingerprint
from zoa_train.data.tokenizer import load_or_train_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class LMData:
    """A tokenizer and the token streams it produced for the train and validation splits."""

    tokenizer: "PreTrainedTokenizerBase"
    train: np.memmap
    validation: np.memmap


def prepare_lm_data(source: TextSource, kind: str, cache_dir: str | Path, tokenizer: str | None = None, vocab_size: int = 8192) -> LMData:
    """Load or train the tokenizer (trained on the train split only), then load or build both token files.

    ``tokenizer`` is a hub name or local directory of a pretrained tokenizer; when empty, one of
    ``vocab_size`` tokens is trained for ``kind`` ("gpt2" or "bert") and cached.
    """
    cache_dir = Path(cache_dir)
    key = hashlib.sha256(f"{source_fingerprint(source)} {kind} {vocab_size}".encode()).hexdigest()[:16]
    tok = load_or_train_tokenizer(
        kind,
        tokenizer,
        iter_texts(source, "train", cache_dir / "datasets"),
        vocab_size,
        cache_dir / f"tokenizer-{kind}-{vocab_size}-{key}",
    )
    return LMData(tok, load_or_build_tokens(source, "train", tok, cache_dir), load_or_build_tokens(source, "validation", tok, cache_dir))
