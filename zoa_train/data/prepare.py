"""One call from a data config to a tokenizer and both splits' token streams: text tokenized into the
token cache (prepare_lm_data), or Megatron indexed datasets read as they are (prepare_megatron_data).

Everything lands under one cache directory, keyed by content, so the first run (or the first
rank) pays for tokenizer training and tokenization and every later run or rank only maps files.
"""

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from zoa_train.data.megatron import check_token_ids, megatron_streams
from zoa_train.data.shards import document_separator, load_or_build_tokens
from zoa_train.data.sources import TextSource, iter_texts, source_fingerprint
from zoa_train.data.tokenizer import load_or_train_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from zoa_train.data.token_stream import TokenStream


@dataclass
class LMData:
    """A tokenizer and the token streams it produced for the train and validation splits."""

    tokenizer: "PreTrainedTokenizerBase"
    train: "np.memmap | TokenStream"  # each document followed by the tokenizer's EOS or [SEP] (document_separator)
    validation: "np.memmap | TokenStream"


def prepare_lm_data(source: TextSource, kind: str, cache_dir: str | Path, tokenizer: str | None = None, vocab_size: int = 8192, workers: int = 0) -> LMData:
    """Load or train the tokenizer (trained on the train split only), then load or build both token files.

    ``tokenizer`` is a hub name or local directory of a pretrained tokenizer; when empty, one of
    ``vocab_size`` tokens is trained for ``kind`` ("gpt2" or "bert") and cached. ``workers`` processes
    tokenize (0: one per CPU core).
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
    return LMData(tok, *(load_or_build_tokens(source, split, tok, cache_dir, workers) for split in ("train", "validation")))


def prepare_megatron_data(
    prefixes: list[str], weights: list[float], validation_prefixes: list[str], tokenizer: str, kind: str, cache_dir: str | Path
) -> LMData:
    """The pretrained tokenizer the prefixes were made with, and the training and validation streams of
    Megatron indexed datasets (zoa_train/data/megatron.py); a token id beyond the tokenizer's vocabulary
    is refused in one sentence."""
    tok = load_or_train_tokenizer(kind, tokenizer, (), 0, cache_dir)
    train, validation, files = megatron_streams(prefixes, weights, validation_prefixes, document_separator(tok))
    check_token_ids(files, len(tok), tokenizer, Path(cache_dir).expanduser())
    return LMData(tok, train, validation)
