"""`zoa-train bench loader RECIPE`: the data loader alone vs a training step on the same micro-batches.

One process: the time to produce a micro-batch (memory-mapped tokens, masking for BERT) against
the time of forward + backward + AdamW step on it, so one sees whether the loader could ever be
the bottleneck. Ratios are measured in the same run.
"""

import time
from pathlib import Path

import torch

from zoa_train.config import Recipe
from zoa_train.data import DistributedBatchLoader, TextSource, lm_blocks, prepare_lm_data
from zoa_train.models import build_model


def run_loader_bench(recipe: Recipe, batches: int = 20) -> dict:
    d = recipe.data
    source = TextSource(name=d.source, config=d.config, train_files=tuple(d.train_files), validation_files=tuple(d.validation_files), text_field=d.text_field)
    data = prepare_lm_data(source, recipe.model.kind, Path(d.cache_dir).expanduser(), d.tokenizer, d.vocab_size)
    blocks = lm_blocks(recipe.model.kind, data.train, d.seq_len, data.tokenizer, recipe.model.next_sentence)
    loader = DistributedBatchLoader(blocks, recipe.train.micro_batch_size, seed=recipe.train.seed)
    next(loader)
    start = time.perf_counter()
    kept = [next(loader) for _ in range(batches)]
    loader_s = (time.perf_counter() - start) / batches

    torch.manual_seed(recipe.train.seed)
    model = build_model(recipe.model, len(data.tokenizer), d.seq_len, data.tokenizer.pad_token_id, data.tokenizer.eos_token_id)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.optimizer.lr, foreach=True)

    def train_step(batch):
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    train_step(kept[0])
    start = time.perf_counter()
    for batch in kept:
        train_step(batch)
    step_s = (time.perf_counter() - start) / batches
    tokens = recipe.train.micro_batch_size * d.seq_len
    return {
        "micro_batch_size": recipe.train.micro_batch_size,
        "seq_len": d.seq_len,
        "threads": torch.get_num_threads(),
        "loader_s_per_batch": loader_s,
        "step_s_per_batch": step_s,
        "loader_tokens_per_s": tokens / loader_s,
        "step_tokens_per_s": tokens / step_s,
        "loader_share_of_step": loader_s / step_s,
    }
