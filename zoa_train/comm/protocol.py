"""The interface between the 1-bit optimizers and the collective that averages their flat buffers.

OneBitAdam and ZeroOneAdam take their collective as an argument, `collective=`, a factory called once
at construction as `collective(sizes, group=..., device=..., ledger=...)`, where `sizes` holds the
tensor sizes of each parameter group. OneBitAllReduce (the flat two-pass 1-bit allreduce) is the
default, and is itself such a factory; `functools.partial(OneBitAllReduce, scale_row=1024)` changes
its scale rows, HierarchicalOneBitAllReduce (zoa_train/comm/hierarchical.py, with its node groups
bound by functools.partial) averages inside each node in full precision and compresses only between
nodes, and a test can pass an exact (full-precision) average to check the optimizers' algebra
alone. The optimizers keep their own flat state in the collective's layouts, accumulate into its
accumulators and save its state per rank, so a collective needs nothing else from them.

BucketedCollective (zoa_train/comm/buckets.py) wraps any of these in buckets of whole tensors and
adds the asynchronous form the optimizers use to overlap their rounds with backward:
`start_exchange(bucket, out, addend)` and `start_allreduce(bucket, tensor, dtype)` start one bucket's
round, `wait()` returns when every started round is done; the calls below stay synchronous.
"""

from collections.abc import Sequence
from typing import Protocol

import torch

from zoa_train.comm.ledger import CommLedger
from zoa_train.comm.onebit import OneBitLayout


class Collective(Protocol):
    """Averages one flat buffer per parameter group over the ranks, error-compensated or exactly."""

    layouts: Sequence[OneBitLayout]  # where each group's tensors lie in its flat buffer

    @property
    def accumulators(self) -> Sequence[torch.Tensor]:
        """Per group, a buffer in its layout that the next `exchange` averages (adding into it
        between calls is the same as passing the sum); its padding stays zero."""

    def exchange(self, out: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        """Average the accumulators (and the carried error) into `out`, one buffer per group, and
        empty the accumulators."""

    def op(self, tensors: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        """Average `tensors` (one buffer per group, in its layout) in place."""

    def allreduce(self, tensor: torch.Tensor, comm_dtype: torch.dtype | None = None, elements: int | None = None, in_step: bool = True) -> torch.Tensor:
        """Average `tensor` (contiguous, any length) in place in full precision over the same ranks and
        topology, recorded in the ledger as zoa_train.comm.allreduce records: the rounds that are not
        1-bit (variance steps, 1-bit Adam's warm-up, BatchNorm statistics)."""

    def state_dicts(self) -> list[dict]:
        """This rank's own state (error buffers), one entry per group."""

    def load_state_dicts(self, states: list[dict]) -> None:
        """Restore `state_dicts()` saved at the same world size and layout; refuse anything else."""

    def layout_state(self) -> list[dict]:
        """A description of the layouts, saved beside buffers kept in them."""

    def relayout(self, flat: torch.Tensor, index: int, saved: dict) -> torch.Tensor:
        """Group `index`'s buffer saved in the layout `saved` (from `layout_state()` of another run),
        moved into this collective's layout (for a run resharded to another world size)."""


class CollectiveFactory(Protocol):
    def __call__(self, sizes: list[list[int]], *, group, device: torch.device | None, ledger: CommLedger) -> Collective: ...


def buckets_of(collective) -> Sequence | None:
    """The buckets a collective starts its rounds in, each with the asynchronous calls above (a
    BucketedCollective's, whatever collective of the registry it wraps), or None: one round per call."""
    return getattr(collective, "buckets", None)
