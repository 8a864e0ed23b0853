"""Corpora, tokenizers and language-model batches for the BERT and GPT-2 recipes.

Typical use on every rank::

    data = prepare_lm_data(TextSource("bundled"), "gpt2", cache_dir)
    loader = DistributedBatchLoader(CausalLMBlocks(data.train, 128), 16, rank, world_size, seed)
    batch = next(loader)  # {"input_ids": (16, 128) int64, "labels": ...}
"""

from zoa_train.data.lm import (
    IGNORE_INDEX,
    CausalLMBlocks,
    DistributedBatchLoader,
    MaskedLMBlocks,
    SentencePairBlocks,
    validation_batches,
)
from zoa_train.data.prepare import LMData, prepare_lm_data
from zoa_train.data.shards import load_or_build_tokens
from zoa_train.data.sources import BUNDLED_CORPUS, TextSource, iter_texts
from zoa_train.data.tokenizer import load_or_train_tokenizer

__all__ = [
    "BUNDLED_CORPUS",
    "IGNORE_INDEX",
    "CausalLMBlocks",
    "DistributedBatchLoader",
    "LMData",
    "MaskedLMBlocks",
    "SentencePairBlocks",
    "TextSource",
    "iter_texts",
    "load_or_build_tokens",
    "load_or_train_tokenizer",
    "prepare_lm_data",
    "validation_batches",
]
