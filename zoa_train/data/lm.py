"""Language-model batches from a flat token stream: packed causal-LM blocks, MLM blocks with dynamic masking.

Blocks are fixed windows of the token stream (documents run across block edges, separated by
their EOS/[SEP] token), so no token is padding. A batch is built by one fancy-index into the
memmap; there is no per-token Python work.

Conventions:
- Causal LM: ``labels`` is ``input_ids`` (the Hugging Face convention): the model shifts them
  itself, as ``GPT2LMHeadModel`` does, so ``model(**batch).loss`` is right as is.
- MLM: ``[CLS] + seq_len - 2 stream tokens + [SEP]``; 15% of the non-special tokens are chosen,
  80% of those become [MASK], 10% a random token, 10% stay; ``labels`` is -100 elsewhere.
  A block's masking (and sentence pair) is drawn from a key of (seed, epoch, block index) alone
  (``sample_keys``), so a block is masked the same way at any world size, micro-batch size and place
  in a batch, a resumed run masks exactly as an uninterrupted one, and each epoch masks it differently.

Which blocks a rank takes, and where it is in them, is ``SampleOrder``'s: one global order of samples
whatever the world size (docs/data.md, "The order of samples").
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
_MASK_STREAM = 2  # keeps training's masking keys apart from other draws keyed by (seed, epoch)
_MASK_DRAWS, _PAIR_DRAWS = 0, 1  # a row key's streams: masking, the sentence pair
_GOLDEN_GAMMA = np.uint64(0x9E3779B97F4A7C15)  # SplitMix64's increment


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 arrays (numpy wraps array arithmetic): each output bit depends on every input bit."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def sample_keys(indices: np.ndarray, *key: int) -> np.ndarray:
    """One uint64 key per sample index, a function of ``key`` (e.g. seed, epoch) and the index alone:
    the index-th output of SplitMix64 started from ``key``."""
    start = np.random.SeedSequence(key).generate_state(1, np.uint64)[0]
    return _mix(start + (np.asarray(indices, dtype=np.uint64) + np.uint64(1)) * _GOLDEN_GAMMA)


def row_draws(keys: np.ndarray, count: int, stream: int) -> np.ndarray:
    """``count`` uint64 draws for each row's key, shape (len(keys), count): SplitMix64 started from the
    key and ``stream``, so that each use of a key draws its own numbers. Vectorised: no per-row Python."""
    starts = _mix(np.asarray(keys, dtype=np.uint64) ^ np.uint64(stream))
    return _mix(starts[:, None] + np.arange(1, count + 1, dtype=np.uint64) * _GOLDEN_GAMMA)


def _uniform(draws: np.ndarray) -> torch.Tensor:
    """uint64 draws as float64 uniforms in [0, 1) (their top 53 bits)."""
    return torch.from_numpy((draws >> np.uint64(11)).astype(np.float64) * 2.0**-53)


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

    def batch(self, indices: np.ndarray, keys: np.ndarray) -> dict[str, torch.Tensor]:
        """A causal-LM batch; ``keys`` (one per row, ``sample_keys``) are unused (nothing is random here) but keep one interface with MLM."""
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

    def batch(self, indices: np.ndarray, keys: np.ndarray) -> dict[str, torch.Tensor]:
        inner = self.stream.rows(indices)
        cls = torch.full((len(inner), 1), self.cls_id)
        sep = torch.full((len(inner), 1), self.sep_id)
        return self.mask(torch.cat([cls, inner, sep], dim=1), keys)

    def mask(self, input_ids: torch.Tensor, keys: np.ndarray) -> dict[str, torch.Tensor]:
        """BERT's 80/10/10 masking of ``input_ids`` (modified in place), never touching special tokens;
        row i's draws come from ``keys[i]`` alone."""
        labels = input_ids.clone()
        maskable = ~torch.isin(input_ids, self.special_ids)
        width = input_ids.shape[1]
        draws = row_draws(keys, 3 * width, _MASK_DRAWS)
        chosen = (_uniform(draws[:, :width]) < self.mask_probability) & maskable
        action = _uniform(draws[:, width : 2 * width])
        random_ids = torch.from_numpy((draws[:, 2 * width :] % np.uint64(self.vocab_size)).astype(np.int64))
        input_ids[chosen & (action < 0.8)] = self.mask_id
        replaced = chosen & (action >= 0.8) & (action < 0.9)
        input_ids[replaced] = random_ids[replaced]
        labels[~chosen] = IGNORE_INDEX
        return {"input_ids": input_ids, "labels": labels}


class SentencePairBlocks(MaskedLMBlocks):
    """MLM blocks as sentence pairs for BERT's next-sentence head: ``[CLS] A [SEP] B [SEP]``.

    A is the first half of a block's stream tokens. B is its second half (label 0, "is next"), or
    with probability 1/2 the second half of another block drawn from the row's key (label 1).
    The halves are cut at a fixed position rather than at sentence ends: the stream is packed and
    has no sentence index, and a fixed cut keeps a batch one fancy-index away.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, tokenizer: "PreTrainedTokenizerBase", mask_probability: float = 0.15):
        if seq_len < 5:
            raise UserError(f"seq_len must be at least 5 for sentence pairs ([CLS] A [SEP] B [SEP]), not {seq_len}.")
        super().__init__(tokens, seq_len - 1, tokenizer, mask_probability)
        self.half = (seq_len - 3) // 2

    def batch(self, indices: np.ndarray, keys: np.ndarray) -> dict[str, torch.Tensor]:
        inner = self.stream.rows(indices)
        rows = len(inner)
        pair = row_draws(keys, 2, _PAIR_DRAWS)
        random_next = _uniform(pair[:, 0]) < 0.5
        others = (pair[:, 1] % np.uint64(len(self.stream))).astype(np.int64)
        first, second = inner[:, : self.half], inner[:, self.half :].clone()
        if random_next.any():
            second[random_next] = self.stream.rows(others[random_next.numpy()])[:, self.half :]
        cls = torch.full((rows, 1), self.cls_id)
        sep = torch.full((rows, 1), self.sep_id)
        input_ids = torch.cat([cls, first, sep, second, sep], dim=1)
        token_type_ids = torch.zeros_like(input_ids)
        token_type_ids[:, self.half + 2 :] = 1
        batch = self.mask(input_ids, keys)
        batch["token_type_ids"] = token_type_ids
        batch["next_sentence_label"] = random_next.long()
        return batch


Blocks = CausalLMBlocks | MaskedLMBlocks


class SampleOrder:
    """Which samples one rank of a data-parallel run takes, and where it is in them.

    Epoch ``e`` orders the ``count`` samples by a permutation drawn from (seed, e) alone. Global batches
    of ``global_batch_size`` samples are cut from it one after another; an epoch ends when less than a
    global batch is left (skipped that epoch). Rank ``r`` takes the ``r``-th of ``world_size`` equal
    slices of each global batch, as its accumulation's micro-batches of ``micro_batch_size`` in order.
    So ranks take disjoint samples, and a global batch is the same samples at any world size and
    micro-batch size.

    The position is (epoch, sample, micro): the samples of the epoch's order that the global batches
    before the current one took, and the micro-batches this rank has taken of the current one. Between
    global batches (micro 0, where every checkpoint is) it is the same on every rank and means the same
    under any world size, micro-batch and global batch size: the next global batch starts at that sample
    (or the next epoch does, if less than a global batch is left), so a run resumed on another layout
    takes no sample twice and skips none.
    """

    LAYOUT = ("world_size", "micro_batch_size", "global_batch_size")

    def __init__(self, count: int, micro_batch_size: int, rank: int, world_size: int, seed: int, global_batch_size: int):
        if not 0 <= rank < world_size or micro_batch_size < 1 or global_batch_size % (world_size * micro_batch_size):
            raise ValueError(
                "need 0 <= rank < world_size, micro_batch_size >= 1 and a global batch divisible by world_size x micro_batch_size, "
                f"got {rank}, {world_size}, {micro_batch_size}, {global_batch_size}"
            )
        if count < global_batch_size:
            raise ValueError(f"{count} samples are fewer than a global batch of {global_batch_size}")
        self.count, self.micro_batch_size, self.rank, self.world_size, self.seed = count, micro_batch_size, rank, world_size, seed
        self.global_batch_size = global_batch_size
        self.accumulation = global_batch_size // (world_size * micro_batch_size)
        self.epoch = self.sample = self.micro = 0
        self._permutation_epoch, self._permutation = -1, np.empty(0, dtype=np.int64)

    def __len__(self) -> int:
        """Micro-batches this rank takes in a whole epoch."""
        return self.count // self.global_batch_size * self.accumulation

    def rows(self) -> np.ndarray:
        """This rank's micro-batches from the position to the end of the epoch: sample indices, shape (n, micro_batch_size)."""
        share = self.global_batch_size // self.world_size
        starts = self.sample + self.global_batch_size * np.arange((self.count - self.sample) // self.global_batch_size)
        offsets = (starts[:, None] + self.rank * share + np.arange(share)).reshape(-1, self.micro_batch_size)[self.micro :]
        return self._epoch_permutation()[offsets]

    def advance(self) -> None:
        """Past one of this rank's micro-batches."""
        self.micro += 1
        if self.micro == self.accumulation:
            self.sample, self.micro = self.sample + self.global_batch_size, 0
            self._next_epoch_if_done()

    def _next_epoch_if_done(self) -> None:
        if self.micro == 0 and self.sample + self.global_batch_size > self.count:
            self.epoch, self.sample = self.epoch + 1, 0

    def _epoch_permutation(self) -> np.ndarray:
        if self._permutation_epoch != self.epoch:
            self._permutation = np.random.default_rng([self.seed, self.epoch]).permutation(self.count)
            self._permutation_epoch = self.epoch
        return self._permutation

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "sample": self.sample, "micro": self.micro} | {key: getattr(self, key) for key in self.LAYOUT}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """The position of ``state``, saved under any layout between global batches; inside one only under this layout."""
        if "batch_index" in state:  # saved before the order was global: batch_index steps of world_size x micro_batch_size samples
            epoch, sample, micro = state["epoch"], state["batch_index"] * state["world_size"] * state["micro_batch_size"], 0
        else:
            epoch, sample, micro = state["epoch"], state["sample"], state["micro"]
            other = [f"{key} {state[key]} (now {getattr(self, key)})" for key in self.LAYOUT if state[key] != getattr(self, key)]
            if micro and other:
                raise UserError(
                    f"Cannot resume the data loader with {', '.join(other)}: its position lies inside a global batch, which only the layout "
                    "that began it can finish; resume from a position between global batches (every checkpoint's)."
                )
        self.epoch, self.sample, self.micro = epoch, sample, micro
        self._next_epoch_if_done()


def check_same_data(saved: dict[str, int], current: dict[str, int]) -> None:
    """Refuse a saved loader position whose data or seed differ from this run's (every key but the
    position and the batch layout, which SampleOrder converts, must match)."""
    for key in (k for k in current if k not in ("epoch", "sample", "micro", *SampleOrder.LAYOUT)):
        if saved[key] != current[key]:
            raise UserError(
                f"Cannot resume the data loader: the checkpoint has {key}={saved[key]} and this run {current[key]}; resume with the same data and seed."
            )


class DistributedBatchLoader:
    """Endless micro-batches of blocks for one rank of a data-parallel run, reshuffled every epoch.

    ``SampleOrder`` says which blocks, in which order (one global order, each global batch split
    among the ranks); ``global_batch_size`` defaults to one micro-batch per rank (no accumulation).
    MLM masking is keyed by (seed, epoch, block index). The position is all the state, so
    ``state_dict`` / ``load_state_dict`` resume exactly, and at another world size, micro-batch or
    global batch size continue at the next unseen block.
    """

    def __init__(self, blocks: Blocks, micro_batch_size: int, rank: int = 0, world_size: int = 1, seed: int = 0, global_batch_size: int | None = None):
        global_batch_size = global_batch_size or world_size * micro_batch_size
        if len(blocks) < global_batch_size:
            raise UserError(
                f"The training data has {len(blocks)} blocks, fewer than a global batch of {global_batch_size}; "
                "use more text, a shorter seq_len or a smaller batch."
            )
        self.blocks, self.seed = blocks, seed
        self.order = SampleOrder(len(blocks), micro_batch_size, rank, world_size, seed, global_batch_size)
        self._rows, self._next = np.empty((0, micro_batch_size), dtype=np.int64), 0  # this rank's micro-batches to the epoch's end

    def __len__(self) -> int:
        """Micro-batches per epoch of this rank (the iterator itself never ends)."""
        return len(self.order)

    def __iter__(self) -> "DistributedBatchLoader":
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._next == len(self._rows):
            self._rows, self._next = self.order.rows(), 0
        indices, epoch = self._rows[self._next], self.order.epoch
        self._next += 1
        self.order.advance()
        return self.blocks.batch(indices, sample_keys(indices, self.seed, epoch, _MASK_STREAM))

    def state_dict(self) -> dict[str, int]:
        """The position plus what must match for it to mean the same blocks on resume."""
        return self.order.state_dict() | {"seed": self.seed, "num_blocks": len(self.blocks)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        check_same_data(state, self.state_dict())
        self.order.load_state_dict(state)
        self._rows, self._next = self._rows[:0], 0


def validation_batches(
    blocks: Blocks, micro_batch_size: int, rank: int = 0, world_size: int = 1, max_batches: int | None = None
) -> Iterator[dict[str, torch.Tensor]]:
    """Yield this rank's validation batches: the same every call, in a fixed order.

    Rank ``r`` gets the ``r``-th of ``world_size`` equal contiguous slices of the blocks; the
    remainder is left out so that every rank runs the same number of batches (their collectives
    stay matched) and the ranks' losses can simply be averaged. MLM masks (and sentence pairs) are
    keyed by the block alone, never by the training seed: runs with different seeds
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
        yield blocks.batch(indices, sample_keys(indices, _VALIDATION_STREAM))
