"""A Megatron-format copy of a recipe's text corpus, written by megatron-core's own IndexedDatasetBuilder
(``pip install --no-deps megatron-core==0.16.1``), to train the same recipe from ``data.source: megatron``
and compare (docs/data.md, "The same tokens, the same loss").

    python scripts/megatron_copy.py recipes/gpt2_tiny.yaml OUT            # each document ends with EOS, as preprocess_data.py --append-eod writes
    python scripts/megatron_copy.py recipes/gpt2_tiny.yaml OUT --no-eod   # without it: zoa-train adds the separator when it reads

Writes OUT/train.bin/.idx and OUT/validation.bin/.idx, one document per document of the recipe's splits,
tokenized as the token cache does (the tokenizer the recipe trains or names, no special tokens added), and
prints the --set flags that train from the copy.
"""

import argparse
import warnings
from pathlib import Path

import numpy as np
import torch

from zoa_train.config import load_recipe
from zoa_train.data import TextSource, iter_texts, prepare_lm_data
from zoa_train.data.shards import document_separator, fast_backend
from zoa_train.models import registry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("out", type=Path)
    parser.add_argument("--no-eod", action="store_true", help="leave the separator out of the files (default: each document ends with it)")
    args = parser.parse_args()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron-core warns that Apex and Transformer Engine are missing
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    recipe = load_recipe(args.recipe)
    d = recipe.data
    source = TextSource(name=d.source, config=d.config, train_files=tuple(d.train_files), validation_files=tuple(d.validation_files), text_field=d.text_field)
    cache_dir = Path(d.cache_dir).expanduser()
    tokenizer = prepare_lm_data(source, registry.get(recipe.model.kind).tokenizer, cache_dir, d.tokenizer, d.vocab_size).tokenizer
    backend, separator = fast_backend(tokenizer), document_separator(tokenizer)
    dtype = np.uint16 if len(tokenizer) <= 2**16 else np.int32
    args.out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "validation"):
        prefix = str(args.out / split)
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
        texts = list(iter_texts(source, split, cache_dir / "datasets"))
        for encoding in backend.encode_batch_fast(texts, add_special_tokens=False):
            ids = encoding.ids if args.no_eod else [*encoding.ids, separator]
            builder.add_document(torch.tensor(ids, dtype=torch.int64), [len(ids)])
        builder.finalize(prefix + ".idx")
        print(f"{prefix}.bin/.idx: {len(texts):,} documents")
    sets = [
        "data.source=megatron",
        f"data.prefixes=[{args.out / 'train'}]",
        f"data.validation_prefixes=[{args.out / 'validation'}]",
        f"data.tokenizer={tokenizer.name_or_path}",
    ]
    print(" ".join(f"--set {s}" for s in sets))


if __name__ == "__main__":
    main()
