"""Node-aware 1-bit allreduce: full precision inside a node, 1-bit error-compensated between nodes.

A flat 1-bit allreduce has every rank's signs cross the slow link between nodes, so a node of G
ranks sends G times what it must (DeepSpeed's 1-bit optimizers work that way). Here, on N nodes of
G ranks (docs/algorithm.md, "Node-aware sync"):
  1. inside the node, a full-precision reduce-scatter (an all-to-all and a local sum in fp32):
     local rank g holds the node's average of shard g (1/G of each buffer, sent in `intra_dtype`);
  2. between nodes, the flat two-pass 1-bit allreduce (OneBitAllReduce) of that shard among the N
     ranks of local rank g, one per node, with its error buffers: the worker error covers the shard
     (1/G of the buffer), the server error 1/(G*N);
  3. inside the node, an fp32 all-gather of the shards.
The full-precision rounds (`allreduce`: variance steps, 1-bit Adam's warm-up, BatchNorm statistics)
take the same three steps with a full-precision allreduce of the shard between nodes.
Every rank ends with the same average: each shard is averaged once, by the ranks that own it,
and copied to the others. A buffer's layout is the flat layout on G*N ranks, so its shards are
whole chunks, its scale rows still follow the tensors, and optimizer state in it is the same as
under the flat collective at that world size. With G = 1 this is the flat allreduce, bit for bit;
with N = 1 it is the exact average (no compression).
"""

import functools
import math

import torch
import torch.distributed as dist

from zoa_train.comm.agreement import check_same_on_every_rank, checked_by_caller
from zoa_train.comm.collectives import allreduce, default_ledger, group_size_rank, refuse_meta, ring_allreduce_bytes
from zoa_train.comm.costs import CallCost, Cluster, allreduce_cost
from zoa_train.comm.layout import SCALE_ROW, LaidOutCollective, OneBitLayout, buffer_sizes, checked_accumulator, collective_device, onebit_layout
from zoa_train.comm.ledger import CommLedger
from zoa_train.comm.onebit import OneBitAllReduce, check_topology, flat_onebit_cost, layout_buffers
from zoa_train.comm.topology import NodeGroups

# torch 2.14 names it all_gather_single and deprecates all_gather_into_tensor; older releases have only that.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def shard_layout(layout: OneBitLayout, index: int, parts: int) -> OneBitLayout:
    """Chunks index*k..(index+1)*k of `layout` (k = its chunks / parts), as a layout of its own for k
    ranks: the tensors cut to the shard, rows and their lengths unchanged."""
    k = layout.padded // layout.chunk // parts
    start, end = index * k * layout.chunk, (index + 1) * k * layout.chunk
    sizes, offsets = [], []
    for offset, size in zip(layout.offsets, layout.sizes):
        first, last = max(offset, start), min(offset + size, end)
        if last > first:
            sizes.append(last - first)
            offsets.append(first - start)
    return OneBitLayout(tuple(sizes), tuple(offsets), k * layout.chunk, layout.chunk, layout.rows, layout.row, layout.segment)


def hierarchical_buffers(
    sizes,
    nodes: int,
    ranks_per_node: int,
    device: torch.device | str = "cpu",
    block_size: int | None = None,
    scale_row: int = SCALE_ROW,
    kernels: str | None = "auto",
) -> dict[str, tuple[int, torch.dtype]]:
    """(elements, dtype) of each buffer a HierarchicalOneBitAllReduce of `sizes` on `nodes` x
    `ranks_per_node` ranks allocates, by the names `held_buffers` gives them: the accumulators
    `_pending`; with G > 1 this rank's shard `_shard` and the all-gather's `_gathered`; with N > 1 the
    flat allreduce of the shard among the nodes, its buffers (`layout_buffers`) prefixed `inter.`.
    The same on every local rank (a shard's layout has the same chunks whichever shard it is)."""
    g = ranks_per_node
    layouts = [onebit_layout(s, nodes * g, scale_row) for s in buffer_sizes(sizes)]
    active = [l for l in layouts if l.active]
    shard = sum(nodes * l.chunk for l in active)
    buffers = {"_pending": (sum(l.padded for l in layouts), torch.float32)}
    if g > 1:
        buffers |= {"_shard": (shard, torch.float32), "_gathered": (g * shard, torch.float32)}
    if nodes > 1 and active:
        inter = layout_buffers([shard_layout(l, 0, g) for l in active], nodes, device, block_size, kernels)
        buffers |= {f"inter.{name}": size for name, size in inter.items()}
    return buffers


def hierarchical_onebit_cost(numel: int, intra_element_size: int, cluster: Cluster, compress_rate: float = math.inf, reduce_rate: float = math.inf) -> CallCost:
    g, nodes = cluster.ranks_per_node, cluster.nodes
    shard = -(-numel // g)
    among_nodes = Cluster(nodes, 1, cluster.bandwidth / g, cluster.latency, cluster.intra_bandwidth, cluster.backend)
    inner = flat_onebit_cost(shard, among_nodes)  # the G local ranks share the node's link
    intra_in = (g - 1) * shard * intra_element_size  # each rank's all-to-all sends (G-1)/G of the buffer
    intra_out = (g - 1) * shard * 4  # fp32 all-gather
    seconds = cluster.phase(0, g * intra_in, 0) + inner.seconds + cluster.phase(0, g * intra_out, 0)
    work = shard / compress_rate + 2 * (g - 1) * shard / reduce_rate  # encoding the shard; the elements sent in full precision
    return CallCost(inner.bytes_per_rank, g * inner.inter_bytes_per_node, seconds + work, intra_in + intra_out, work)


def hierarchical_allreduce_cost(numel: int, element_size: int, cluster: Cluster, reduce_rate: float = math.inf) -> CallCost:
    """The node-aware full-precision allreduce (HierarchicalOneBitAllReduce.allreduce): a reduce-scatter
    inside the node, a ring allreduce of each rank's shard among the nodes (the G local ranks sharing
    the node's link), an fp32 all-gather inside the node."""
    g, nodes = cluster.ranks_per_node, cluster.nodes
    shard = -(-numel // g)
    inner = allreduce_cost(
        shard, element_size, Cluster(nodes, 1, cluster.bandwidth / g, cluster.latency, cluster.intra_bandwidth, cluster.backend), reduce_rate
    )
    intra_in, intra_out = (g - 1) * shard * element_size, (g - 1) * shard * 4
    reducing = (g - 1) * shard / reduce_rate  # the elements summed inside the node
    seconds = cluster.phase(0, g * intra_in, 0) + inner.seconds + cluster.phase(0, g * intra_out, 0) + reducing
    return CallCost(inner.bytes_per_rank, g * inner.inter_bytes_per_node, seconds, intra_in + intra_out, inner.work_seconds + reducing)


class HierarchicalOneBitAllReduce(LaidOutCollective):
    """A Collective (zoa_train/comm/protocol.py) that averages flat buffers over `nodes` (a NodeGroups
    of the world: zoa_train.comm.topology.node_groups): full precision inside each node, 1-bit
    error-compensated between nodes. A factory for the optimizers is
    `functools.partial(HierarchicalOneBitAllReduce, nodes=node_groups(...))`.

    `intra_dtype`: what the reduce-scatter inside the node sends (fp32 or bf16; the sum is fp32); the
    all-gather is fp32, so every rank holds the shard owners' exact values. `block_size`,
    `scale_row` and `kernels` are the flat allreduce's. `inter`: the collective between nodes (default
    OneBitAllReduce), called as `inter(None, group=, device=, ledger=, layouts=)` with the shards'
    layouts; a test passes an exact one to check the composition alone. The accumulators are a buffer of their own (the error lives
    in the shard's flat allreduce), empty between calls, or `accumulator` (as OneBitAllReduce's).
    """

    def __init__(
        self,
        sizes,
        group=None,
        device: torch.device | str | None = None,
        ledger: CommLedger | None = None,
        *,
        nodes: NodeGroups,
        intra_dtype: torch.dtype = torch.float32,
        block_size: int | None = None,
        scale_row: int = SCALE_ROW,
        inter=None,
        kernels: str = "auto",
        accumulator: torch.Tensor | None = None,
    ):
        self.group = group
        self.world_size, self.rank = group_size_rank(group)
        if self.world_size != nodes.world_size:
            raise ValueError(f"the node groups span {nodes.world_size} ranks and the process group {self.world_size}")
        if intra_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"intra_dtype must be torch.float32 or torch.bfloat16, got {intra_dtype}")
        self.nodes, self.intra_dtype, self.scale_row = nodes, intra_dtype, scale_row
        self.device = collective_device(device, group, "HierarchicalOneBitAllReduce")
        self.ledger = ledger if ledger is not None else default_ledger()
        self.layouts = [onebit_layout(s, self.world_size, scale_row) for s in buffer_sizes(sizes)]
        settings = {"nodes": f"{nodes.nodes}x{nodes.ranks_per_node}", "scale_row": scale_row, "intra_dtype": str(intra_dtype).removeprefix("torch.")}
        check_same_on_every_rank("HierarchicalOneBitAllReduce", group, [l.sizes for l in self.layouts], settings)
        self.numel = sum(l.numel for l in self.layouts)
        n, g = nodes.nodes, nodes.ranks_per_node
        self._shards = [n * l.chunk if l.active else 0 for l in self.layouts]  # elements of each buffer's shard
        self._shard_total = sum(self._shards)
        self._scratch: dict = {}  # LaidOutCollective.op's, for packed tensors
        self._pending = torch.zeros(sum(l.padded for l in self.layouts), device=self.device)
        if accumulator is not None:  # the caller's storage (see OneBitAllReduce)
            self._pending = checked_accumulator(accumulator, self._pending)
        self._accumulators = list(self._pending.split([l.padded for l in self.layouts]))
        if g > 1:
            self._shard = torch.zeros(self._shard_total, device=self.device)  # this rank's shard of every buffer
            self._gathered = torch.zeros(g * self._shard_total, device=self.device)  # the all-gather's, ordered by source
            # The all-to-all inside the node sends from _gathered (free until the all-gather), ordered by
            # destination, and receives into _pending (free once copied out): no buffers of its own.
            elements = g * self._shard_total
            self._send = self._gathered.view(intra_dtype)[:elements]
            self._received = self._pending[:elements].view(intra_dtype)[:elements]
        active = [l for l in self.layouts if l.active]
        self._inter = None
        if n > 1 and active:
            shards = [shard_layout(l, nodes.local_rank, g) for l in active]
            inter = inter or functools.partial(OneBitAllReduce, block_size=block_size, scale_row=scale_row, kernels=kernels)
            with checked_by_caller():  # the shards follow from what was compared above
                self._inter = inter(None, group=nodes.inter, device=self.device, ledger=self.ledger, layouts=shards)

    @property
    def accumulators(self) -> list[torch.Tensor]:
        """Per buffer, a buffer in its layout that the next `exchange()` averages; adding into it
        between calls is the same as passing the sum to `op`. Its padding must stay zero."""
        return self._accumulators

    def held_buffers(self) -> dict[str, torch.Tensor]:
        """Every buffer this collective holds, by the names `hierarchical_buffers` sizes them by."""
        held = {"_pending": self._pending}
        if self.nodes.ranks_per_node > 1:
            held |= {"_shard": self._shard, "_gathered": self._gathered}
        if self._inter is not None:
            held |= {f"inter.{name}": t for name, t in self._inter.held_buffers().items()}
        return held

    @property
    def bytes_per_call(self) -> int:
        """Bytes this rank sends between nodes in one call."""
        return self._inter.bytes_per_call if self._inter is not None else 0

    @property
    def intra_bytes_per_call(self) -> int:
        """Bytes this rank sends inside its node in one call: the reduce-scatter and the all-gather."""
        g = self.nodes.ranks_per_node
        if g < 2:
            return 0
        element = torch.finfo(self.intra_dtype).bits // 8
        return ring_allreduce_bytes(g * self._shard_total, element + 4, g) // 2

    def exchange(self, out, addend=None):
        """Average accumulator (+ addend) of every buffer into `out` (buffers in the layouts; their
        padding is zero afterwards), empty the accumulators, and return `out`."""
        outs = self._laid_out_buffers(out)
        addends = self._laid_out_buffers(addend) if addend is not None else [None] * len(outs)
        for acc, a in zip(self._accumulators, addends):
            if a is not None:
                acc.add_(a)
        g = self.nodes.ranks_per_node
        if self.world_size < 2:
            for acc, o in zip(self._accumulators, outs):
                o.copy_(acc)
            self._pending.zero_()
            return out
        shards = self._reduce_inside_node() if g > 1 else [acc for acc, size in zip(self._accumulators, self._shards) if size]
        if self._inter is not None:
            self._inter.exchange(out=shards, addend=shards)  # the shard's average over the nodes, in place
        if g > 1:
            self._gather_inside_node(outs)
        else:
            for o, acc in zip(outs, self._accumulators):
                o.copy_(acc)
            self._pending.zero_()
        return out

    def allreduce(self, tensor: torch.Tensor, comm_dtype: torch.dtype | None = None, elements: int | None = None, in_step: bool = True) -> torch.Tensor:
        """Average `tensor` in place in full precision, node-aware: a reduce-scatter inside the node
        (an all-to-all in `intra_dtype`, or bf16 where `comm_dtype` is, summed in fp32), an allreduce
        of this rank's shard among the ranks that hold it on the other nodes (in `comm_dtype`, as a
        flat round would send), and an fp32 all-gather inside the node. A node sends 1/G of what a
        flat allreduce sends over its link; every rank ends with the shard owners' values, so all
        agree exactly. The ledger counts the shard on the slow link and the rest as "intra"."""
        refuse_meta(tensor)
        g, n = self.nodes.ranks_per_node, self.nodes.nodes
        if self.world_size < 2 or g == 1 or n == 1:  # one rank a node, or one node: the flat ring is node-aware already
            return allreduce(tensor, group=self.group, ledger=self.ledger, comm_dtype=comm_dtype, elements=elements, in_step=in_step)
        flat = tensor.view(-1)
        numel = flat.numel()
        elements = numel if elements is None else elements
        shard = -(-numel // g)
        intra = torch.bfloat16 if comm_dtype == torch.bfloat16 else self.intra_dtype
        send = torch.zeros(g * shard, dtype=intra, device=flat.device)
        send[:numel].copy_(flat)
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=self.nodes.intra)
        mine = torch.sum(received.view(g, shard), dim=0, dtype=torch.float32)
        owned = min(shard, max(0, numel - self.nodes.local_rank * shard))  # this shard's part of the tensor
        allreduce(mine, group=self.nodes.inter, ledger=self.ledger, comm_dtype=comm_dtype, elements=elements * owned // numel, in_step=in_step)
        mine.div_(g)  # the nodes' mean of the node sums, over the node's ranks: the mean of all
        gathered = torch.empty(g * shard, dtype=torch.float32, device=flat.device)
        _all_gather(gathered, mine, group=self.nodes.intra)
        flat.copy_(gathered[:numel])
        bits = torch.finfo(intra).bits
        self.ledger.record(
            f"intra_allreduce_{str(intra).removeprefix('torch.')}",
            payload_bits=(bits + 32) // 2,
            elements=elements,
            bytes_sent=(g - 1) * shard * (bits // 8 + 4),
            calls=2,
            in_step=in_step,
            link="intra",
        )
        return tensor

    def _pieces(self, flat: torch.Tensor):
        """(buffer, its (G, shard) view in a (G, all shards) tensor `flat`) for every active buffer."""
        g, column = self.nodes.ranks_per_node, 0
        grid = flat.view(g, self._shard_total)
        for index, size in enumerate(self._shards):
            if size:
                yield index, grid[:, column : column + size]
                column += size

    def _reduce_inside_node(self) -> list[torch.Tensor]:
        """The node's average of this rank's shard of every buffer (views of `_shard`)."""
        g = self.nodes.ranks_per_node
        for index, piece in self._pieces(self._send):
            piece.copy_(self._accumulators[index].view(g, -1))
        # A reduce-scatter as an all-to-all and a sum here: the same bytes, and a collective that Gloo
        # also takes on CUDA tensors (gpu_check runs ranks sharing one GPU through it).
        dist.all_to_all_single(self._received, self._send, group=self.nodes.intra)
        torch.sum(self._received.view(g, -1), dim=0, dtype=torch.float32, out=self._shard)
        self._shard.mul_(1.0 / g)
        self._pending.zero_()  # the accumulators are empty again (and the received values gone)
        return list(self._shard.split([size for size in self._shards if size]))

    def _gather_inside_node(self, outs: list[torch.Tensor]) -> None:
        g = self.nodes.ranks_per_node
        _all_gather(self._gathered, self._shard, group=self.nodes.intra)
        for index, piece in self._pieces(self._gathered):
            outs[index].view(g, -1).copy_(piece)
        for o, size in zip(outs, self._shards):
            if not size:  # an inactive buffer (no elements) has nothing to average
                o.zero_()
        # The reduce-scatter and the all-gather are the two halves of an allreduce, counted as one: its
        # payload bits the mean of the halves' (32 in fp32, 24 with a bf16 reduce-scatter), as a flat
        # allreduce counts once, and the bytes of both.
        bits = torch.finfo(self.intra_dtype).bits
        self.ledger.record(
            f"intra_allreduce_{str(self.intra_dtype).removeprefix('torch.')}",
            payload_bits=(bits + 32) // 2,
            elements=self.numel,
            bytes_sent=self.intra_bytes_per_call,
            calls=2,
            link="intra",
        )

    def _topology(self) -> dict:
        """What a saved state must match: the shape and which ranks share a node (the same on every
        rank, so all of them accept a checkpoint or all refuse it)."""
        return {"nodes": self.nodes.nodes, "ranks_per_node": self.nodes.ranks_per_node, "members": [list(m) for m in self.nodes.members]}

    def state_dicts(self) -> list[dict]:
        """One state per buffer: the shard's error buffers (flat allreduce state) and anything added
        to the accumulator since the last call (None when empty, as it is between optimizer steps)."""
        inner = iter(self._inter.state_dicts()) if self._inter is not None else None
        states = []
        for layout, accumulator in zip(self.layouts, self._accumulators):
            states.append(
                {
                    "topology": self._topology(),
                    "numel": layout.numel,
                    "world_size": self.world_size,
                    "layout": (layout.offsets, layout.padded, layout.row),
                    "pending": accumulator.clone() if accumulator.any() else None,
                    "shard": next(inner) if inner is not None and layout.active else None,
                }
            )
        return states

    def load_state_dicts(self, states: list[dict]) -> None:
        if len(states) != len(self.layouts):
            raise ValueError(f"1-bit allreduce state is for {len(states)} buffers, this one has {len(self.layouts)}")
        shard_states = []
        for layout, accumulator, state in zip(self.layouts, self._accumulators, states):
            check_topology(state, self._topology())
            if state["numel"] != layout.numel or state["layout"] != (layout.offsets, layout.padded, layout.row):
                raise ValueError("1-bit allreduce state was saved with another layout; it cannot be resumed here")
            accumulator.copy_(state["pending"]) if state["pending"] is not None else accumulator.zero_()
            if state["shard"] is not None:
                shard_states.append(state["shard"])
        if self._inter is not None:
            self._inter.load_state_dicts(shard_states)
