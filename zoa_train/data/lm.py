"""Language-model batches from a flat token stream: packed causal-LM blocks, MLM blocks with dynamic masking.

Blocks are fixed windows of the token stream (documents run across block edges, separated by
their EOS/[SEP] token), so no token is padding. A batch is built by one fancy-index into the
memmap; there is no per-token Python work.

Conventions:
- Causal LM: ``labels`` is ``input_ids`` (the Hugging Face convention): the model shifts them
  itself, as ``GPT2LMHeadModel`` does, so ``model(**batch).loss`` is right as is.
- MLM: ``[CLS] + seq_len - 2 stream tokens + [SEP]``; 15% of the non-special tokens are chosen,
  80% of those become [MASK], 10% a random token, 10% stay; ``labels`` is -100 elsewhere.
  Masking is drawn at batch time from a generator seeded by (seed, rank, step), so a resumed run
  masks exactly as an uninterrupted one, and each epoch masks the same block differently.
"""

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

from zoa_train.errors import UserError

if TYPE_CHECKING:  # transformers takes seconds to import; batching never needs it at run time
    from transformers import PreTrainedTokenizerBase

IGNORE_INDEX = -100  # label value that torch's cross-entropy (and HF models) skip
_VALIDATION_STREAM = 1  # keeps validation masking draws apart from training's


class CausalLMBlocks:
    """Consecutive, non-overlapping windows of ``seq_len`` tokens; the tail shorter than a window is dropped."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return len(self.tokens) // self.seq_len

    def rows(self, indices: np.ndarray) -> torch.Tensor:
        """Blocks ``indices`` as an int64 tensor of shape (len(indices), seq_len)."""
        starts = np.asarray(indices, dtype=np.int64)[:, None] * self.seq_len
        return torch.from_numpy(self.tokens[starts + np.arange(self.seq_len)].astype(np.int64))

    def batch(self, indices: np.ndarray, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """A causal-LM batch; ``generator`` is unused (nothing is random here) but keeps one interface with MLM."""
        input_ids = self.rows(indices)
        return {"input_ids": input_ids, "labels": input_ids.clone()}


class MaskedLMBlocks:
    """Windows of ``seq_len - 2`` stream tokens framed by [CLS] and [SEP], masked at batch time."""

    def __init__(self, tokens: np.ndarray, seq_len: int, tokenizer: "PreTrainedTokenizerBase", mask_probability: float = 0.15):
        if seq_len < 3:
            raise UserError(f"seq_len must be at least 3 for MLM ([CLS], a token, [SEP]), not {seq_len}.")
        self.stream = CausalLMBlocks(tokens, seq_len - 2)
        self.cls_id, self.sep_id, self.mask_id = tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.mask_token_id
        self.vocab_size = len(tokenizer)
        self.special_ids = torch.tensor(sorted(set(tokenizer.all_special_ids)))
        self.mask_probability = mask_probability

    def __len__(self) -> int:
        return len(self.stream)

    def batch(self, indices: np.ndarray, generator: torch.Generator) -> dict[str, torch.Tensor]:
        inner = self.stream.rows(indices)
        cls = torch.full((len(inner), 1), self.cls_id)
        sep = torch.full((len(inner), 1), self.sep_id)
        return self.mask(torch.cat([cls, inner, sep], dim=1), generator)

    def mask(self, input_ids: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """BERT's 80/10/10 masking of ``input_ids`` (modified in place), never touching special tokens."""
        labels = input_ids.clone()
        maskable = ~torch.isin(input_ids, self.special_ids)
        chosen = (torch.rand(input_ids.shape, generator=generator) < self.mask_probability) & maskable
        action = torch.rand(input_ids.shape, generator=generator)
        random_ids = torch.randint(self.vocab_size, input_ids.shape, generator=generator)
        input_ids[chosen & (action < 0.8)] = self.mask_id
        replaced = chosen & (action >= 0.8) & (action < 0.9)
        input_ids[replaced] = random_ids[replaced]
        labels[~chosen] = IGNORE_INDEX
        return {"input_ids": input_ids, "labels": labels}


class SentencePairBlocks(MaskedLMBlocks):
    """MLM blocks as sentence pairs for BERT's next-sentence head: ``[CLS] A [SEP] B [SEP]``.

    A is the first half of a block's stream tokens. B is its second half (label 0, "is next"), or
    with probability 1/2 the second half of another block drawn from the same generator (label 1).
    The halves are cut at a fixed position rather than at sentence ends: the stream is packed and
    has no sentence index, and a fixed cut keeps a batch one fancy-index away.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, tokenizer: "PreTrainedTokenizerBase", mask_probability: float = 0.15):
        if seq_len < 5:
            raise UserError(f"seq_len must be at least 5 for sentence pairs ([CLS] A [SEP] B [SEP]), not {seq_len}.")
        super().__init__(tokens, seq_len - 1, tokenizer, mask_probability)
        self.half = (seq_len - 3) // 2

    def batch(self, indices: np.ndarray, generator: torch.Generator) -> dict[str, torch.Tensor]:
        inner = self.stream.rows(indices)
        rows = len(inner)
        random_next = torch.rand(rows, generator=generator) < 0.5
        others = torch.randint(len(self.stream), (rows,), generator=generator).numpy()
        first, second = inner[:, : self.half], inner[:, self.half :].clone()
        if random_next.any():
            second[random_next] = self.stream.rows(others[random_next.numpy()])[:, self.half :]
        cls = torch.full((rows, 1), self.cls_id)
        sep = torch.full((rows, 1), self.sep_id)
        input_ids = torch.cat([cls, first, sep, second, sep], dim=1)
        token_type_ids = torch.zeros_like(input_ids)
        token_type_ids[:, self.half + 2 :] = 1
        batch = self.mask(input_ids, generator)
        batch["token_type_ids"] = token_type_ids
        batch["next_sentence_label"] = random_next.long()
        return batch


Blocks = CausalLMBlocks | MaskedLMBlocks


def epoch_rank_order(count: int, seed: int, epoch: int, batches: int, world_size: int, micro_batch_size: int, rank: int) -> np.ndarray:
    """Rank `rank`'s sample indices for `epoch`, shape (batches, micro_batch_size): a permutation drawn
    from (seed, epoch) alone, so every rank computes the same one, cut into global batches of
    world_size * micro_batch_size of which each rank takes its own slice; the tail is skipped."""
    permutation = np.random.default_rng([seed, epoch]).permutation(count)
    used = permutation[: batches * world_size * micro_batch_size]
    return used.reshape(batches, world_size, micro_batch_size)[:, rank]


def check_same_data(saved: dict[str, int], current: dict[str, int]) -> None:
    """Refuse a saved loader position whose data or batch settings differ from this run's (every key
    but the position itself must match)."""
    for key in (k for k in current if k not in ("epoch", "batch_index")):
        if saved[key] != current[key]:
            raise UserError(
                f"Cannot resume the data loader: the checkpoint has {key}={saved[key]} and this run {current[key]}; "
                "resume with the same data and batch settings."
            )


def step_generator(*keys: int) -> torch.Generator:
    """A torch generator seeded from several integers, mixed so that nearby keys give unrelated streams."""
    seed = int(np.random.SeedSequence(keys).generate_state(1, np.uint64)[0])
    return torch.Generator().manual_seed(seed)


class DistributedBatchLoader:
    """Endless micro-batches for one rank of a data-parallel run, reshuffled every epoch.

    Epoch ``e`` orders all blocks by a permutation drawn from (seed, e) alone, so every rank
    computes the same one; global step ``b`` takes the next ``world_size * micro_batch_size``
    blocks of it and rank ``r`` the ``r``-th ``micro_batch_size`` of those. Ranks therefore see
    disjoint blocks, and a global batch is the same set of blocks at any world size with the same
    global batch size. The few blocks left over at the end of an epoch are skipped that epoch.
    The position (epoch, batch index) is all the state, so ``state_dict`` / ``load_state_dict``
    resume exactly.
    """

    def __init__(self, blocks: Blocks, micro_batch_size: int, rank: int = 0, world_size: int = 1, seed: int = 0):
        if not 0 <= rank < world_size or micro_batch_size < 1:
            raise ValueError(f"need 0 <= rank < world_size and micro_batch_size >= 1, got {rank}, {world_size}, {micro_batch_size}")
        self.blocks, self.micro_batch_size, self.rank, self.world_size, self.seed = blocks, micro_batch_size, rank, world_size, seed
        self.batches_per_epoch = len(blocks) // (world_size * micro_batch_size)
        if self.batches_per_epoch == 0:
            raise UserError(
                f"The training data has {len(blocks)} blocks, fewer than world size x micro batch size "
                f"= {world_size * micro_batch_size}; use more text, a shorter seq_len or a smaller batch."
            )
        self.epoch = self.batch_index = 0
        self._order_epoch, self._order = -1, np.empty(0, dtype=np.int64)

    def __len__(self) -> int:
        """Batches per epoch (the iterator itself never ends)."""
        return self.batches_per_epoch

    def __iter__(self) -> "DistributedBatchLoader":
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.batch_index == self.batches_per_epoch:
            self.epoch, self.batch_index = self.epoch + 1, 0
        step = self.epoch * self.batches_per_epoch + self.batch_index
        indices = self._rank_order()[self.batch_index]
        self.batch_index += 1
        return self.blocks.batch(indices, step_generator(self.seed, self.rank, step))

    def _rank_order(self) -> np.ndarray:
        """This rank's block indices for the current epoch, shape (batches_per_epoch, micro_batch_size); cached per epoch."""
        if self._order_epoch != self.epoch:
            self._order = epoch_rank_order(len(self.blocks), self.seed, self.epoch, self.batches_per_epoch, self.world_size, self.micro_batch_size, self.rank)
            self._order_epoch = self.epoch
        return self._order

    def state_dict(self) -> dict[str, int]:
        """The position plus what must match for it to mean the same batches on resume."""
        return {
            "epoch": self.epoch,
            "batch_index": self.batch_index,
            "seed": self.seed,
            "world_size": self.world_size,
            "micro_batch_size": self.micro_batch_size,
            "num_blocks": len(self.blocks),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        check_same_data(state, self.state_dict())
        self.epoch, self.batch_index = state["epoch"], state["batch_index"]


def validation_batches(
    blocks: Blocks, micro_batch_size: int, rank: int = 0, world_size: int = 1, max_batches: int | None = None
) -> Iterator[dict[str, torch.Tensor]]:
    """Yield this rank's validation batches: the same every call, in a fixed order.

    Rank ``r`` gets the ``r``-th of ``world_size`` equal contiguous slices of the blocks; the
    remainder is left out so that every rank runs the same number of batches (their collectives
    stay matched) and the ranks' losses can simply be averaged. MLM masks (and sentence pairs) are
    seeded by the batch's first block alone, never by the training seed: runs with different seeds
    are scored on the same validation set, so their losses differ only by what training did
    (seeded masks once made BERT's seed-to-seed spread look larger than it is).
    """
    per_rank = len(blocks) // (world_size * micro_batch_size)
    if per_rank == 0:
        raise UserError(
            f"The validation data has {len(blocks)} blocks, fewer than world size x micro batch size "
            f"= {world_size * micro_batch_size}; use more validation text or a smaller batch."
        )
    if max_batches is not None:
        per_rank = min(per_rank, max_batches)
    first = rank * (len(blocks) // world_size)
    for i in range(per_rank):
        start = first + i * micro_batch_size
        indices = np.arange(start, start + micro_batch_size)
        yield blocks.batch(indices, step_generator(_VALIDATION_STREAM, start))
