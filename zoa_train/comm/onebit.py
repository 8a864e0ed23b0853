"""Error-compensated 1-bit allreduce (docs/algorithm.md, "The 1-bit allreduce").

Two passes over a flat buffer cut into rows of `row` elements, each row with its own scale:
  worker  y = x + e_w; per row send sign(y) and s = RMS(y); e_w <- y - s*sign(y)
  pass 1  all_to_all: rank j gets chunk j (a run of whole rows) of every rank's signs and scales
  server  c = mean_i(s_i*sign_i) + e_s; per row send sign(c) and s = RMS(c); e_s <- c - s*sign(c)
  pass 2  all_gather of the server signs and scales; every rank unpacks the same average
Each segment on the wire is the packed signs of one chunk followed by its fp32 row scales, so a
call is exactly two collectives.

Rows follow the tensors. The buffer is laid out from a list of tensor sizes (`onebit_layout`, in
zoa_train/comm/layout.py with what every collective of such buffers shares):
every tensor of at least a row starts on a row boundary, and a run of smaller tensors (biases,
norms) is packed from one, so no scale is shared by an embedding matrix and a dense layer, whose
magnitudes and sparsity differ. A sign costs no more for a zero than for a nonzero, so the scale is
what keeps a sparse embedding gradient from being drowned by (or drowning) its neighbours (on
gpt2_tiny, rows cut across tensors trained 0/1 Adam worse: docs/results/convergence.md, ablation 1). The
padding after each tensor run and at the end carries no value: it is excluded from the scales,
its error stays zero, and it is zero in the output, so optimizers keep their state in this layout.

The passes (worker, server, output) are fused kernels where the device has them, Triton on GPUs
and C++ on CPUs, else torch ops (zoa_train/comm/kernels/: one module per backend, chosen in one
place); every backend computes the same thing, so the choice changes speed and scratch memory, not
the wire format. The error buffers always hold the errors themselves.
Several buffers (an optimizer's parameter groups, each in its own layout) share one call: each
wire segment holds every buffer's part for that rank, so all groups cost two collectives.
"""

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from zoa_train.comm.agreement import check_same_on_every_rank
from zoa_train.comm.collectives import default_ledger, group_size_rank
from zoa_train.comm.costs import CallCost, Cluster, allgather_cost
from zoa_train.comm.kernels import PartViews, select_kernels
from zoa_train.comm.layout import (  # noqa: F401 -- ONEBIT_DTYPES and checked_buffers: still importable from here
    ONEBIT_DTYPES,
    SCALE_ROW,
    LaidOutCollective,
    OneBitLayout,
    buffer_sizes,
    checked_accumulator,
    checked_buffers,
    collective_device,
    onebit_layout,
)
from zoa_train.comm.ledger import CommLedger

# torch 2.14 documents all_gather_single and deprecates all_gather_into_tensor (a FutureWarning on
# every call); older releases have only the latter.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def onebit_buffers(
    sizes,
    world_size: int,
    device: torch.device | str = "cpu",
    block_size: int | None = None,
    scale_row: int = SCALE_ROW,
    kernels: str | None = "auto",
) -> dict[str, tuple[int, torch.dtype]]:
    """(elements, dtype) of each buffer a OneBitAllReduce of `sizes` (see OneBitAllReduce)
    allocates: the error buffers `_worker` (e_w, also the accumulator) and `_server` (e_s of this
    rank's chunks), the wire buffers `_send`, `_recv`, `_gathered` (n segments each) and `_mine`
    (one), and the scratch of its kernels (`kernels`, resolved on `device`: none for the fused ones,
    per-block buffers for the torch path; None: none, as the fused kernels, without resolving a
    backend here, for a plan of another machine). Inactive (one rank or no elements): worker
    buffers of numel and all others empty."""
    layouts = [onebit_layout(s, world_size, scale_row) for s in buffer_sizes(sizes)]
    return layout_buffers(layouts, world_size, device, block_size, kernels)


def layout_buffers(
    layouts: Sequence[OneBitLayout], world_size: int, device: torch.device | str = "cpu", block_size: int | None = None, kernels: str | None = "auto"
) -> dict[str, tuple[int, torch.dtype]]:
    """`onebit_buffers` of a OneBitAllReduce built with `layouts` (buffers already laid out: the
    node-aware sync's shards)."""
    device = torch.device(device)
    active = [l for l in layouts if l.active]
    scratch = select_kernels(kernels, device).scratch(active, world_size, device, block_size) if active and kernels is not None else {}
    return _allocations(layouts, world_size) | scratch


def _allocations(layouts: Sequence[OneBitLayout], world_size: int) -> dict[str, tuple[int, torch.dtype]]:
    segment = sum(l.segment for l in layouts if l.active)
    return {
        "_worker": (sum(l.padded for l in layouts), torch.float32),
        "_server": (sum(l.chunk for l in layouts if l.active), torch.float32),
        "_send": (world_size * segment, torch.uint8),
        "_recv": (world_size * segment, torch.uint8),
        "_gathered": (world_size * segment, torch.uint8),
        "_mine": (segment, torch.uint8),
    }


def _wire_views(wire: torch.Tensor, column: int, layout: OneBitLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed signs (k, chunk/8), fp32 row scales (k, rows)) of one buffer in each of a wire
    buffer's k segments, where that buffer's part starts at byte `column` of a segment."""
    packed = layout.chunk // 8
    part = wire[:, column : column + layout.segment]
    return part[:, :packed], part[:, packed:].view(torch.float32)


class OneBitAllReduce(LaidOutCollective):
    """Averages flat buffers in their layouts over a process group with 1-bit error-compensated compression.

    `sizes`: the sizes of the tensors one buffer holds (or one size), or a list of such lists for
    several buffers (the parameter groups of an optimizer), each with its own layout
    (`layouts[i]`, `layout` when there is one) and all averaged by one call: one all_to_all and
    one all_gather whose segments hold every buffer's part. Owns the worker error (fp32, in the
    layouts, back to back) and the server error (this rank's chunks, fp32) and all communication
    buffers, allocated once on `device` (default: the process group's device, CUDA for NCCL).
    Math is fp32 whatever the input dtype. With a world size of 1, `op` returns its input
    unchanged and sends nothing, and `exchange` returns the accumulator exactly. `kernels` chooses
    the passes' backend (zoa_train/comm/kernels: "auto", "torch", "native", "triton"); it and
    `block_size` (elements per step of a torch-path pass; default 512K on CPU, the whole buffer up
    to 128M elsewhere) change speed and scratch memory, not the wire format; `scale_row` is part
    of the wire format and must be the same on every rank. `layouts` (instead of `sizes`): buffers
    already laid out for this group's size, such as the node-aware sync's shards
    (zoa_train/comm/hierarchical.py). `accumulator`: where the worker error (the accumulators)
    lives, a zeroed fp32 tensor of the layouts' padded elements on `device` (a view of a larger
    buffer: the buckets of zoa_train/comm/buckets.py share one per parameter group); default its own.
    """

    def __init__(
        self,
        sizes,
        group=None,
        device: torch.device | str | None = None,
        ledger: CommLedger | None = None,
        block_size: int | None = None,
        scale_row: int = SCALE_ROW,
        layouts: Sequence[OneBitLayout] | None = None,
        kernels: str = "auto",
        accumulator: torch.Tensor | None = None,
    ):
        self.group = group
        self.world_size, self.rank = group_size_rank(group)
        self.device = collective_device(device, group, "OneBitAllReduce")
        self.ledger = ledger if ledger is not None else default_ledger()
        self.scale_row = scale_row
        if layouts is None:
            layouts = [onebit_layout(s, self.world_size, scale_row) for s in buffer_sizes(sizes)]
        elif any(l.active and l.padded != self.world_size * l.chunk for l in layouts):
            raise ValueError(f"these layouts are not cut into {self.world_size} chunks, one per rank of the group")
        self.layouts = list(layouts)
        check_same_on_every_rank("OneBitAllReduce", group, [l.sizes for l in self.layouts], {"scale_row": scale_row}, self.layouts)
        self.numel = sum(l.numel for l in self.layouts)
        for name, (size, dtype) in _allocations(self.layouts, self.world_size).items():
            setattr(self, name, torch.zeros(size, dtype=dtype, device=self.device))
        if accumulator is not None:
            self._worker = checked_accumulator(accumulator, self._worker)
        self._accumulators = list(self._worker.split([l.padded for l in self.layouts]))
        self._scratch: dict[tuple[int, torch.dtype], torch.Tensor] = {}  # see _laid_out
        self._segment = sum(l.segment for l in self.layouts if l.active)
        self._parts: list[PartViews | None] = []
        worker = server = column = 0
        for layout in self.layouts:
            self._parts.append(self._part(layout, worker, server, column) if layout.active else None)
            worker += layout.padded
            if layout.active:
                server, column = server + layout.chunk, column + layout.segment
        self._active = [i for i, part in enumerate(self._parts) if part is not None]
        parts = [self._parts[i] for i in self._active]
        self.kernels = select_kernels(kernels, self.device)(parts, self.device, block_size) if parts else None

    def _part(self, layout: OneBitLayout, worker: int, server: int, column: int) -> PartViews:
        """The views of one buffer that starts at these offsets of _worker, _server and a wire segment."""
        n, rows, row = self.world_size, layout.rows, layout.row
        wires = [w.view(-1, self._segment) for w in (self._send, self._recv, self._gathered, self._mine)]
        (send_signs, send_scales), (recv_signs, recv_scales), (gathered_signs, gathered_scales), (mine_signs, mine_scales) = (
            _wire_views(w, column, layout) for w in wires
        )
        valid = layout.row_lengths().view(n, rows)
        return PartViews(
            worker=self._worker[worker : worker + layout.padded].view(n, rows, row),
            valid=valid.to(torch.int32).to(self.device),
            # sqrt of the number of real elements in each row, for the RMS; >= 1.
            norm=valid.clamp(min=1).to(torch.float32).sqrt().to(self.device),
            send_signs=send_signs,
            send_scales=send_scales,
            recv_signs=recv_signs,
            recv_scales=recv_scales,
            server=self._server[server : server + layout.chunk].view(1, rows, row),
            rank=self.rank,
            mine_signs=mine_signs,
            mine_scales=mine_scales,
            gathered_signs=gathered_signs,
            gathered_scales=gathered_scales,
        )

    def _only(self) -> int:
        """0, the index of the only buffer (for the one-buffer interface)."""
        if len(self.layouts) != 1:
            raise ValueError(f"this OneBitAllReduce has {len(self.layouts)} buffers: use the per-buffer interface")
        return 0

    @property
    def layout(self) -> OneBitLayout:
        """The layout of the only buffer."""
        return self.layouts[self._only()]

    def held_buffers(self) -> dict[str, torch.Tensor]:
        """Every buffer this collective holds, by the names `onebit_buffers` sizes them by: the error
        and wire buffers and its kernels' scratch (for memory accounting: `bench optim`)."""
        held = {name: getattr(self, name) for name in _allocations(self.layouts, self.world_size)}
        return held | (self.kernels.held_buffers() if self.kernels is not None else {})

    @property
    def bytes_per_call(self) -> int:
        """Bytes this rank sends in one call: (n-1) segments in each pass."""
        return 2 * (self.world_size - 1) * self._segment

    @property
    def accumulators(self) -> list[torch.Tensor]:
        """Each buffer's part of the worker buffer (in its layout) that the next `exchange()`
        compresses, the carried error included.

        Adding into it between calls is the same as passing the sum to `op`; optimizers use it to
        accumulate their update without a buffer of their own. Its padding must stay zero.
        """
        return self._accumulators

    @property
    def accumulator(self) -> torch.Tensor:
        """The accumulator of the only buffer (see `accumulators`)."""
        return self._accumulators[self._only()]

    @property
    def worker_error(self) -> torch.Tensor:
        """The worker error e_w (all buffers, padded, back to back), as a new tensor."""
        return self._worker.clone()

    @property
    def server_error(self) -> torch.Tensor:
        """The server error e_s of this rank's chunks, as a new tensor."""
        return self._server.clone()

    def exchange(self, out, addend=None):
        """Compress accumulator + error (+ addend), run both passes, write the average to `out`
        (each a buffer in the layout, or a list of them, one per buffer; the padding of `out` is
        zero afterwards), and return `out`."""
        outs = self._laid_out_buffers(out)
        addends = self._laid_out_buffers(addend) if addend is not None else [None] * len(outs)
        if self.world_size < 2:  # one rank: the average is the input itself
            for acc, o, a in zip(self._accumulators, outs, addends):
                torch.add(acc, a, out=o) if a is not None else o.copy_(acc)
            self._worker.zero_()
            return out
        # (the kernels' index of each buffer with elements, its output, its addend)
        active = [(k, outs[i], addends[i]) for k, i in enumerate(self._active)]
        if not active:
            return out
        for index, _, a in active:  # worker: y = e_w + addend, compressed into the send segments
            self.kernels.worker(index, a)
        dist.all_to_all_single(self._recv, self._send, group=self.group)  # pass 1: rank j receives chunk j of everyone
        for index, _, _ in active:  # server: c = e_s + mean_i(s_i*sign_i) over this rank's chunk, compressed
            self.kernels.server(index)
        _all_gather(self._gathered, self._mine, group=self.group)  # pass 2: every server chunk to everyone
        for index, o, _ in active:
            self.kernels.output(index, o)
        self.ledger.record("onebit_allreduce", payload_bits=1, elements=self.numel, bytes_sent=self.bytes_per_call, calls=2)
        return out

    def state_dicts(self) -> list[dict]:
        """One state per buffer, each as a OneBitAllReduce of that buffer alone saves it."""
        states, server = [], 0
        for layout, accumulator in zip(self.layouts, self._accumulators):
            chunk = layout.chunk if layout.active else 0
            states.append(
                {
                    "topology": "flat",
                    "numel": layout.numel,
                    "world_size": self.world_size,
                    "layout": (layout.offsets, layout.padded, layout.row),
                    "worker_error": accumulator.clone(),
                    "server_error": self._server[server : server + chunk].clone(),
                }
            )
            server += chunk
        return states

    def load_state_dicts(self, states: list[dict]) -> None:
        if len(states) != len(self.layouts):
            raise ValueError(f"1-bit allreduce state is for {len(states)} buffers, this one has {len(self.layouts)}")
        server = 0
        for layout, accumulator, state in zip(self.layouts, self._accumulators, states):
            check_topology(state, "flat")
            if state["world_size"] != self.world_size or state["numel"] != layout.numel:
                raise ValueError(
                    f"1-bit allreduce state is for {state['numel']} elements on {state['world_size']} ranks, "
                    f"this one is for {layout.numel} on {self.world_size}"
                )
            if state.get("layout") != (layout.offsets, layout.padded, layout.row):
                raise ValueError("1-bit allreduce state was saved with another layout (an older zoa-train?); it cannot be resumed here")
            chunk = layout.chunk if layout.active else 0
            accumulator.copy_(state["worker_error"])
            self._server[server : server + chunk].copy_(state["server_error"])
            server += chunk

    def state_dict(self) -> dict:
        """The state of the only buffer (see `state_dicts`)."""
        return self.state_dicts()[self._only()]

    def load_state_dict(self, state: dict) -> None:
        self.load_state_dicts([state])


class TopologyChanged(ValueError):
    """The error buffers were saved by a collective of another topology (flat, or node-aware over
    another shape): their layouts differ, so they cannot be resumed; --reshard restarts them at zero."""


def describe_topology(topology) -> str:
    """A saved topology entry in words: "flat 1-bit sync" or "node-aware 1-bit sync over N nodes x G
    ranks (nodes [[0, 1], [2, 3]])"."""
    if topology == "flat":
        return "flat 1-bit sync"
    if "buckets" in topology:
        return f"1-bit sync in buckets of {topology['buckets'][0]['bucket_cap_mb']:g} MB"
    members = f" (nodes {topology['members']})" if "members" in topology else ""
    return f"node-aware 1-bit sync over {topology['nodes']} nodes x {topology['ranks_per_node']} ranks{members}"


def check_topology(state: dict, expected) -> None:
    """Refuse a collective's saved state whose topology is not `expected` (states saved before
    topologies existed are flat)."""
    saved = state.get("topology", "flat")
    if saved != expected:
        raise TopologyChanged(
            f"its 1-bit error buffers were saved by the {describe_topology(saved)} and this run uses the {describe_topology(expected)}; "
            "resume with the same comm.topology and node layout, or pass --reshard to continue with the error buffers at zero"
        )


def onebit_call_bytes(num_params: int, world_size: int) -> int:
    """Bytes one rank sends in one flat OneBitAllReduce call: 2(n-1) segments (signs and row scales)."""
    return 2 * (world_size - 1) * onebit_layout(num_params, world_size).segment


def flat_onebit_cost(numel: int, cluster: Cluster, compress_rate: float = math.inf, scale_row: int = SCALE_ROW) -> CallCost:
    """A flat OneBitAllReduce call of `numel` elements on `cluster`: the all-to-all of every rank's
    segments, the all-gather of the server segments, and the encoding of the buffer."""
    n, g, nodes = cluster.world, cluster.ranks_per_node, cluster.nodes
    if n == 1:
        return CallCost(0, 0, 0.0)
    segment = onebit_layout(numel, n, scale_row).segment
    to_all_inter = g * g * (nodes - 1) * segment
    to_all = cluster.phase(to_all_inter, g * (g - 1) * segment, n - 1)
    gather = allgather_cost(segment, cluster)  # of the server segments
    work = numel / compress_rate  # encoding and decoding the buffer
    return CallCost(2 * (n - 1) * segment, to_all_inter + gather.inter_bytes_per_node, to_all + gather.seconds + work, work_seconds=work)
