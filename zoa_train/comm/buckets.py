"""The 1-bit exchange in buckets, started while backward still runs (docs/algorithm.md, "Overlap").

DDP hides its allreduce behind backward by cutting the gradients into buckets of whole tensors, in
reverse registration order (roughly the order backward finishes them), and starting each bucket's
allreduce as soon as its gradients are final. BucketedCollective does the same for the 1-bit
optimizers' exchanges: each parameter group's tensors are cut into buckets of at most
`bucket_cap_mb` MB of fp32 (a larger tensor alone), each bucket a collective of its own (its own
1-bit layout, rows, chunks and error buffers: OneBitAllReduce or the node-aware one), and a group's
flat buffer is its buckets' buffers back to back. The optimizer does a bucket's share of the step
(its momentum, its displacement) when the bucket's gradients are final and starts its exchange;
`wait()` returns when every started exchange is done.

With `overlap`, exchanges run in the order they are started on one background thread per
collective (and, on a GPU, its own stream), over process groups of their own, so the caller's
collectives (a loss average, an overflow check) never interleave with them. Buckets are started
in bucket order on every rank, which is what keeps the ranks' collectives matched. Without
`overlap` each exchange runs when it is started, in the caller: the same arithmetic, bucket for
bucket, so the two paths agree to the bit.
"""

import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from zoa_train.comm.agreement import check_same_on_every_rank, checked_by_caller
from zoa_train.comm.collectives import group_size_rank
from zoa_train.comm.layout import SCALE_ROW, OneBitLayout, buffer_sizes, checked_buffers, collective_device, onebit_layout, relayout
from zoa_train.comm.ledger import CommLedger
from zoa_train.comm.onebit import TopologyChanged

# Four times DDP's 25 MB: a 1-bit bucket sends 32x fewer bytes than an fp32 one for the same messages,
# so its fixed cost weighs more; `plan` on 16 x 8 GPUs finds 100 MB better than 25 in every row (docs/results/overlap.md).
BUCKET_CAP_MB = 100.0


class GroupLayout(NamedTuple):
    """Where each tensor of a parameter group lies in its flat buffer: its buckets' layouts back to back."""

    sizes: tuple[int, ...]
    offsets: tuple[int, ...]
    padded: int

    @property
    def numel(self) -> int:
        return sum(self.sizes)


@dataclass
class Bucket:
    """A run of whole tensors of one parameter group, exchanged by a collective of its own."""

    index: int  # its place in the order buckets are started
    group: int
    tensors: list[int]  # the tensors' indices in their group, in the order the bucket lays them out
    start: int  # its slice of the group's flat buffer
    stop: int
    layout: OneBitLayout
    comm: object = None  # a Collective of one buffer

    @property
    def numel(self) -> int:
        return self.layout.numel


class TensorOrder(NamedTuple):
    """How `plan_buckets` cuts and orders buckets, per parameter group and tensor: `sizes`, the elements
    the cap counts (the whole tensor's where each rank holds a shard, so that a node's ranks cut alike),
    and `ready`, when its gradient is final in backward (smaller first; ties in reverse listing)."""

    sizes: Sequence[Sequence[int]]
    ready: Sequence[Sequence[int]]


def listing_order(model: torch.nn.Module, groups: Sequence[dict]) -> TensorOrder:
    """The order DDP assumes, for `groups` (parameter groups of `model`, as an optimizer takes them): each
    gradient final in the reverse of model.parameters()'s order, across groups, so that every group's
    buckets follow the layers as backward finishes them. (Without an order the groups are taken one after
    the other: the small group of biases and norms, complete only when the first layer is, is started
    first and holds every other bucket back.)"""
    position = {id(p): n for n, p in enumerate(model.parameters())}
    return TensorOrder([[p.numel() for p in g["params"]] for g in groups], [[len(position) - position[id(p)] for p in g["params"]] for g in groups])


def plan_buckets(sizes: Sequence[Sequence[int]], world_size: int, cap_elements: int, scale_row: int, order: TensorOrder | None = None) -> list[Bucket]:
    """Buckets of whole tensors, each from one group, in the order their gradients are expected to be
    final: by default the tensors of all groups in reverse order (the groups' tensors taken as listed,
    group after group), or as `order` says. Walking the tensors in that order, each group's run is cut
    when it would pass `cap_elements` (a larger tensor is a bucket alone); buckets are started in the
    order their last tensor is reached, as that is when they are complete."""
    listed = [(g, i) for g, group in enumerate(sizes) for i in range(len(group))]
    counted = sizes
    if order is None:
        walk = listed[::-1]
    else:
        if [len(g) for g in order.sizes] != [len(g) for g in sizes] or [len(g) for g in order.ready] != [len(g) for g in sizes]:
            raise ValueError("a TensorOrder must give a size and a readiness for every tensor of every group")
        counted = order.sizes
        position = {t: n for n, t in enumerate(listed)}
        walk = sorted(listed, key=lambda t: (order.ready[t[0]][t[1]], -position[t]))
    reached = {t: n for n, t in enumerate(walk)}
    open_runs: dict[int, list[int]] = {}
    runs: list[tuple[int, list[int]]] = []
    for g, i in walk:
        run = open_runs.get(g)
        if run and sum(counted[g][j] for j in run) + counted[g][i] > cap_elements:
            runs.append((g, run))
            run = None
        if run is None:
            run = open_runs[g] = []
        run.append(i)
    runs += [(g, run) for g, run in open_runs.items() if run]
    runs.sort(key=lambda r: max(reached[(r[0], i)] for i in r[1]))
    buckets, ends = [], [0] * len(sizes)
    for index, (g, run) in enumerate(runs):
        layout = onebit_layout([sizes[g][i] for i in run], world_size, scale_row)
        buckets.append(Bucket(index, g, run, ends[g], ends[g] + layout.padded, layout))
        ends[g] += layout.padded
    return buckets


class CommThread:
    """Runs jobs in the order they are submitted on one daemon thread (on a GPU under a stream of
    its own that first waits for the submitter's stream), so that collectives started during
    backward proceed while the caller computes. A job's exception is raised by `wait`. The seconds
    the jobs took and those `wait` blocked go to `ledger.record_time` (host seconds: on a GPU, the
    time to queue the work)."""

    def __init__(self, device: torch.device, ledger: CommLedger | None = None):
        self.ledger = ledger
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._thread: threading.Thread | None = None
        self._pending: list[Future] = []

    def submit(self, job: Callable[[], None]) -> None:
        ready = None
        if self._stream is not None:  # the job reads what the caller's stream has computed so far
            ready = torch.cuda.Event()
            ready.record()
        future: Future = Future()
        self._pending.append(future)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="zoa-train-comm", daemon=True)
            self._thread.start()
        self._jobs.put((job, future, ready))

    def close(self) -> None:
        """End the thread once the jobs submitted so far are done."""
        if self._thread is not None:
            self._jobs.put((None, None, None))
            self._thread = None

    def _run(self) -> None:
        while True:
            job, future, ready = self._jobs.get()
            if job is None:
                return
            try:
                started = time.perf_counter()
                with torch.no_grad():
                    if self._stream is None:
                        job()
                    else:
                        with torch.cuda.stream(self._stream):
                            self._stream.wait_event(ready)
                            job()
                if self.ledger is not None:
                    self.ledger.record_time(round_seconds=time.perf_counter() - started)
                future.set_result(None)
            except BaseException as error:  # raised in the caller, by wait()
                future.set_exception(error)
            job = future = ready = None  # hold nothing while idle: a job holds its collective's buffers and group

    def wait(self) -> None:
        pending, self._pending = self._pending, []
        started = time.perf_counter()
        errors = [f.exception() for f in pending]  # waits for every job, even after a failure
        if pending and self.ledger is not None:
            self.ledger.record_time(exposed_seconds=time.perf_counter() - started)
        if self._stream is not None:
            torch.cuda.current_stream().wait_stream(self._stream)
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first


def duplicate_group(group):
    """A new process group of the same ranks as `group` (None: the world). A collective over the world:
    torch makes a group only where every rank makes it, so where ranks hold different groups (the ranks
    of one shard on each node, comm.shard node) every rank makes all of them, in one order."""
    world = dist.get_world_size()
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    if len(ranks) == world:
        return dist.new_group(ranks)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, ranks)
    mine = None
    for members in sorted(set(map(tuple, everyone))):
        made = dist.new_group(list(members))
        if members == tuple(ranks):
            mine = made
    return mine


class BucketedCollective:
    """A Collective (zoa_train/comm/protocol.py) whose exchanges run bucket by bucket, and can be
    started one bucket at a time while backward runs (module docstring).

    `inner(sizes, group=, device=, ledger=, accumulator=)` builds one bucket's collective
    (OneBitAllReduce, or the node-aware one with its node groups bound); with `overlap` it is given
    `group` duplicated (`duplicate_group`), since its collectives run on another thread. A factory
    for the optimizers is `functools.partial(BucketedCollective, inner=..., bucket_cap_mb=...,
    overlap=...)`. `start_exchange`/`start_allreduce` start one bucket's round, `wait` finishes all
    that were started; `exchange`, `op` and `allreduce` are the synchronous Collective calls,
    bucket by bucket. `order` (TensorOrder) cuts and orders the buckets by when backward finishes each
    tensor's gradient; for parameters sharded by FSDP2 it is needed, since the node's ranks must cut
    alike (zoa_train.comm.sharding.gradient_order).
    """

    def __init__(
        self,
        sizes,
        group=None,
        device: torch.device | str | None = None,
        ledger: CommLedger | None = None,
        *,
        inner,
        bucket_cap_mb: float = BUCKET_CAP_MB,
        overlap: bool = False,
        scale_row: int = SCALE_ROW,
        order: TensorOrder | None = None,
    ):
        if not 0 < bucket_cap_mb < float("inf"):
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        self.group, self.ledger, self.overlap = group, ledger, overlap
        self.world_size, self.rank = group_size_rank(group)
        self.device = collective_device(device, group, "BucketedCollective")
        self.scale_row = scale_row
        self.bucket_cap_mb = bucket_cap_mb
        sizes = [[s] if isinstance(s, int) else list(s) for s in buffer_sizes(sizes)]
        # Before duplicate_group, which every rank must call: one all-gather for every bucket's collective.
        settings = {"bucket_cap_mb": bucket_cap_mb, "overlap": overlap, "scale_row": scale_row}
        check_same_on_every_rank("BucketedCollective", group, sizes, settings, layout=order)
        self.buckets = plan_buckets(sizes, self.world_size, max(1, int(bucket_cap_mb * 2**20 // 4)), self.scale_row, order)
        self.layouts: list[GroupLayout] = []
        for g, group_sizes in enumerate(sizes):
            offsets = [0] * len(group_sizes)
            for bucket in (b for b in self.buckets if b.group == g):
                for i, offset in zip(bucket.tensors, bucket.layout.offsets):
                    offsets[i] = bucket.start + offset
            padded = max((b.stop for b in self.buckets if b.group == g), default=0)
            self.layouts.append(GroupLayout(tuple(group_sizes), tuple(offsets), padded))
        self._accumulators = [torch.zeros(layout.padded, device=self.device) for layout in self.layouts]
        comm_group = duplicate_group(group) if overlap and self.world_size > 1 else group
        for bucket in self.buckets:
            with checked_by_caller():
                bucket.comm = inner(
                    [bucket.layout.sizes],
                    group=comm_group,
                    device=self.device,
                    ledger=ledger,
                    scale_row=scale_row,
                    accumulator=self._accumulators[bucket.group][bucket.start : bucket.stop],
                )
            if bucket.comm.layouts[0].padded != bucket.layout.padded:
                raise ValueError("a bucket's collective laid it out differently from BucketedCollective")
        self._thread = CommThread(self.device, ledger) if overlap and self.world_size > 1 else None
        if self._thread is not None:
            weakref.finalize(self, self._thread.close)

    # ---- one bucket at a time ------------------------------------------------------------------

    def start_exchange(self, index: int, out: torch.Tensor, addend: torch.Tensor | None = None) -> None:
        """Start bucket `index`'s 1-bit exchange: its accumulator (+ its slice of `addend`, a buffer of
        its group) averaged into its slice of `out` (a buffer of its group)."""
        bucket = self.buckets[index]
        part_out = out[bucket.start : bucket.stop]
        part_addend = addend[bucket.start : bucket.stop] if addend is not None else None
        self._run(lambda: bucket.comm.exchange(out=[part_out], addend=[part_addend] if part_addend is not None else None))

    def start_allreduce(self, index: int, tensor: torch.Tensor, comm_dtype: torch.dtype | None = None) -> None:
        """Start bucket `index`'s full-precision average of its slice of `tensor` (a buffer of its group), in place."""
        bucket = self.buckets[index]
        part = tensor[bucket.start : bucket.stop]
        self._run(lambda: bucket.comm.allreduce(part, comm_dtype=comm_dtype, elements=bucket.numel, in_step=True))

    def _run(self, job: Callable[[], None]) -> None:
        if self._thread is None:  # in the caller: all of it is exposed
            started = time.perf_counter()
            job()
            if self.ledger is not None:
                seconds = time.perf_counter() - started
                self.ledger.record_time(round_seconds=seconds, exposed_seconds=seconds)
        else:
            self._thread.submit(job)

    def wait(self) -> None:
        """Return when every started round is done (raising a round's error)."""
        if self._thread is not None:
            self._thread.wait()

    # ---- the Collective protocol, bucket by bucket ---------------------------------------------

    @property
    def accumulators(self) -> list[torch.Tensor]:
        """Per group, its buckets' accumulators back to back (see OneBitAllReduce.accumulators)."""
        return self._accumulators

    def exchange(self, out, addend=None):
        outs = self._per_group(out, laid_out=True)
        addends = self._per_group(addend, laid_out=True) if addend is not None else [None] * len(outs)
        for bucket in self.buckets:
            self.start_exchange(bucket.index, outs[bucket.group], addends[bucket.group])
        self.wait()
        return out

    def op(self, tensors):
        """Average buffers in the groups' layouts in place (padded buffers only)."""
        buffers = self._per_group(tensors)
        for t, layout in zip(buffers, self.layouts):
            if t.numel() != layout.padded or not t.is_contiguous():
                raise ValueError(f"a BucketedCollective averages contiguous buffers in its layout ({layout.padded} elements), got {t.numel()}")
        self.exchange(out=[t.view(-1) for t in buffers], addend=[t.view(-1) for t in buffers])
        return tensors

    def allreduce(self, tensor: torch.Tensor, comm_dtype: torch.dtype | None = None, elements: int | None = None, in_step: bool = True) -> torch.Tensor:
        """A full-precision average of any tensor over the same topology (between rounds: nothing may be in flight)."""
        self.wait()
        return self.buckets[0].comm.allreduce(tensor, comm_dtype=comm_dtype, elements=elements, in_step=in_step)

    def _per_group(self, tensors, laid_out: bool = False) -> list[torch.Tensor]:
        return checked_buffers("BucketedCollective", tensors, self.layouts, self.device, laid_out)

    def describe_buckets(self) -> list[dict]:
        """The bucketing, as saved: per group, its buckets' tensors (what a resume must match)."""
        return [{"bucket_cap_mb": self.bucket_cap_mb, "buckets": [b.tensors for b in self.buckets if b.group == g]} for g in range(len(self.layouts))]

    def state_dicts(self) -> list[dict]:
        states = []
        for g, described in enumerate(self.describe_buckets()):
            inner = [b.comm.state_dicts()[0] for b in self.buckets if b.group == g]
            states.append({"topology": {"buckets": described, "world_size": self.world_size}, "buckets": inner})
        return states

    def load_state_dicts(self, states: list[dict]) -> None:
        if len(states) != len(self.layouts):
            raise ValueError(f"1-bit allreduce state is for {len(states)} buffers, this one has {len(self.layouts)}")
        for g, (state, described) in enumerate(zip(states, self.describe_buckets())):
            saved = state.get("topology")
            if not isinstance(saved, dict) or saved.get("buckets") != described:
                was = f"in buckets of {saved['buckets']['bucket_cap_mb']} MB" if isinstance(saved, dict) and "buckets" in saved else "unbucketed"
                if was == f"in buckets of {self.bucket_cap_mb} MB":  # the same cap, the tensors taken in another order
                    raise TopologyChanged(
                        f"its 1-bit error buffers were saved in other buckets of {self.bucket_cap_mb} MB (the tensors taken in another order); "
                        "pass --reshard to continue with the error buffers at zero"
                    )
                raise TopologyChanged(
                    f"its 1-bit error buffers were saved {was} and this run exchanges in buckets of {self.bucket_cap_mb} MB; "
                    "resume with the same comm.bucket_cap_mb, or pass --reshard to continue with the error buffers at zero"
                )
            for bucket, inner in zip((b for b in self.buckets if b.group == g), state["buckets"]):
                bucket.comm.load_state_dicts([inner])

    def layout_state(self) -> list[dict]:
        return [{"world_size": self.world_size, "offsets": list(l.offsets), "padded": l.padded} for l in self.layouts]

    def relayout(self, flat: torch.Tensor, index: int, saved: dict) -> torch.Tensor:
        return relayout(flat, self.layouts[index], saved, self.scale_row)
