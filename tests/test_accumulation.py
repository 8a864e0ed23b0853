"""Gradient accumulation sends nothing between nodes until the last micro-batch (docs/algorithm.md,
"Gradient accumulation"), on every path: sharded inside the node (comm.shard node: FSDP2; HSDP for
adam) and node-aware (comm.topology hierarchical or auto), for every optimizer, overlapped rounds too.

One launch of 4 Gloo ranks as 2 emulated nodes x 2 (comm.ranks_per_node 2) runs the trainer's own
`Trainer.train_step` (on a stand-in for the trainer's attributes: the model, the optimizer the registry
builds as the trainer does, a loss) for a few steps of 2 micro-batches, and again of 1 from the same
start. What each micro-batch sends is counted three ways, each split into inside the node ("intra") and
between nodes ("inter"):
  ledger  what the optimizer records in its CommLedger (its `record` wrapped);
  calls   every collective issued on any process group, seen by c10d's pre-hook on the group (this sees
          DDP's C++ reducer and FSDP2 as well as zoa_train's own calls), classed by the group's ranks;
  wire    the bytes each rank received on its TCP connections (the kernel's tcpi_bytes_received per
          socket), classed by the rank at the other end; the rendezvous store's connections apart.
A micro-batch's counts are taken between barriers of a process group counted nowhere, so nothing of
one micro-batch is counted in another. The last micro-batch's counts include the step and zero_grad.
"""

import collections
import functools
import inspect
import os
import socket
import struct
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from distributed_harness import run_ranks

WIDTH = 32
UNITS = 3  # the FSDP2 units with parameters: Blocks.layers (the root holds none of its own)
SHARDED = {"shard": "node", "ranks_per_node": 2, "kernels": "torch"}
NODE_AWARE = {"topology": "hierarchical", "ranks_per_node": 2, "kernels": "torch"}
OVERLAPPED = {
    "topology": "auto",
    "ranks_per_node": 2,
    "kernels": "torch",
    "overlap": True,
    "bucket_cap_mb": 5000 / 2**20,
}  # a bucket per tensor group of a layer
ZERO_ONE = {"var_freeze_step": 1, "var_update_scaler": 1, "local_steps": "fixed", "local_step_interval": 2}  # a variance, a local and a 1-bit step

# (name, optimizer section, comm section, steps): the steps cover each optimizer's kinds of step
CASES = (
    ("adam sharded (HSDP)", {"name": "adam"}, SHARDED, 2),
    ("onebit_adam sharded", {"name": "onebit_adam", "freeze_step": 1}, SHARDED, 2),  # warm-up, 1-bit
    ("zero_one_adam sharded", {"name": "zero_one_adam", **ZERO_ONE}, SHARDED, 3),
    ("diloco sharded", {"name": "diloco", "sync_every": 2}, SHARDED, 2),  # inner, outer
    ("adam (DDP)", {"name": "adam"}, NODE_AWARE, 2),  # 2 steps: DDP lays its buckets out anew after the first
    ("powersgd (DDP)", {"name": "powersgd", "freeze_step": 2}, NODE_AWARE, 3),  # full precision twice, then low rank
    ("onebit_adam node-aware", {"name": "onebit_adam", "freeze_step": 1}, NODE_AWARE, 2),
    ("zero_one_adam node-aware", {"name": "zero_one_adam", **ZERO_ONE}, NODE_AWARE, 3),
    ("diloco node-aware, 1-bit outer", {"name": "diloco", "sync_every": 2, "outer_collective": "onebit"}, NODE_AWARE, 2),
    ("onebit_adam overlapped", {"name": "onebit_adam", "freeze_step": 1}, OVERLAPPED, 2),
    ("zero_one_adam overlapped", {"name": "zero_one_adam", **ZERO_ONE}, OVERLAPPED, 3),
)
ACCUM = 2


class Blocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(UNITS))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x)) + x
        return x


# ---- the three counts ---------------------------------------------------------------------------


def _tcp_sockets() -> dict[int, tuple]:
    """This process's TCP sockets: fd -> (own address, peer address or None)."""
    found = {}
    for fd in map(int, os.listdir("/proc/self/fd")):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(fd))
        except OSError:  # closed meanwhile
            continue
        with s:
            if s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM:
                try:
                    found[fd] = (s.getsockname()[:2], s.getpeername()[:2])
                except OSError:  # a listening socket
                    found[fd] = (s.getsockname()[:2], None)
    return found


def _bytes_received(fd: int) -> int:
    with socket.socket(fileno=os.dup(fd)) as s:
        return struct.unpack_from("Q", s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256), 128)[0]  # struct tcp_info's tcpi_bytes_received


class Counts:
    """This rank's counts so far, by (source, link, what): ("ledger" | "calls", link, "calls" | "bytes"),
    ("wire", link | "store", "bytes"), and ("ops" | "op_bytes", link, collective) for the calls by name."""

    def __init__(self, quiet, quiet_sockets: set[int]):
        self.quiet, self.quiet_sockets = quiet, quiet_sockets
        self.rank = dist.get_rank()
        self.values = collections.Counter()
        self.lock = threading.Lock()  # overlapped rounds record from a thread of their own
        self.hooked: set[str] = set()
        self.sockets: dict[int, str] = {}

    @staticmethod
    def node(rank: int) -> int:
        return rank // 2

    def link(self, ranks) -> str:
        return "intra" if len({self.node(r) for r in ranks}) == 1 else "inter"

    def add(self, counted: dict) -> None:
        with self.lock:
            self.values.update(counted)

    def count_ledger(self, ledger) -> None:
        record, signature = ledger.record, inspect.signature(ledger.record)

        def counted(*args, **kwargs):
            a = signature.bind(*args, **kwargs)
            a.apply_defaults()
            self.add({("ledger", a.arguments["link"], "calls"): a.arguments["calls"], ("ledger", a.arguments["link"], "bytes"): a.arguments["bytes_sent"]})
            record(*args, **kwargs)

        ledger.record = counted

    def count_calls(self) -> None:
        """A pre-hook on every process group made so far (c10d's private list of them) but the quiet one."""
        for group in list(dist.distributed_c10d._world.pg_map):
            if group is self.quiet or group.group_name in self.hooked:
                continue
            self.hooked.add(group.group_name)
            link = self.link(dist.get_process_group_ranks(group))

            def hook(args, link=link):
                nbytes = sum(t.numel() * t.element_size() for t in args.input_tensors)
                op = args.name.name
                self.add({("calls", link, "calls"): 1, ("calls", link, "bytes"): nbytes, ("ops", link, op): 1, ("op_bytes", link, op): nbytes})

            group.register_pre_hook(len(self.hooked), hook)

    def map_sockets(self) -> None:
        """The link of each TCP connection, from which rank owns its other end (every rank's own
        addresses, one all-gather on the quiet group); the rendezvous store's (its server is in rank 0)
        are "store"; the quiet group's are left out."""
        mine = _tcp_sockets()
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, [own for own, _ in mine.values()], group=self.quiet)
        owner = {tuple(address): r for r, addresses in enumerate(every) for address in addresses}
        store = dist.distributed_c10d._get_default_store()
        while not hasattr(store, "port"):  # the PrefixStores around the TCPStore
            store = store.underlying_store
        self.sockets = {}
        for fd, (own, peer) in mine.items():
            if peer is not None and fd not in self.quiet_sockets:
                self.sockets[fd] = "store" if store.port in (own[1], peer[1]) else "intra" if self.node(owner[tuple(peer)]) == self.node(self.rank) else "inter"

    def snapshot(self) -> collections.Counter:
        """Everything so far, once every rank has finished what came before and before any goes on."""
        dist.barrier(group=self.quiet)
        now = collections.Counter()
        for fd, link in self.sockets.items():
            now["wire", link, "bytes"] += _bytes_received(fd)
        with self.lock:
            now.update(self.values)
        dist.barrier(group=self.quiet)
        return now

    def check_no_socket_opened(self) -> None:
        opened = {fd for fd, (_, peer) in _tcp_sockets().items() if peer is not None} - set(self.sockets) - self.quiet_sockets
        assert not opened, f"rank {self.rank}: connections opened after the sockets were mapped (not counted): {opened}"


def _difference(after: collections.Counter, before: collections.Counter) -> dict:
    return {key: after[key] - before[key] for key in set(after) | set(before) if after[key] != before[key]}


# ---- training through the trainer's train_step ------------------------------------------------------


def _build(optimizer: dict, comm: dict, accum: int, sharding):
    """The recipe, and the model and optimizer as Trainer._build makes them."""
    from zoa_train.comm import ClusterCollective, OneBitAllReduce
    from zoa_train.config import recipe_from_dict
    from zoa_train.optim import registry

    train = {"nproc": 4, "micro_batch_size": 4, "global_batch_size": 4 * 4 * accum}
    recipe = recipe_from_dict({"optimizer": {"lr": 1e-3, **optimizer}, "comm": comm, "train": train})
    torch.manual_seed(0)
    model = Blocks()
    c = recipe.comm
    if c.shard == "node":
        sync = functools.partial(OneBitAllReduce, kernels=c.kernels)
    else:
        sync, sharding = ClusterCollective(c.topology, c.ranks_per_node, torch.float32, c.kernels, c.bucket_cap_mb, c.overlap), None
    return recipe, model, registry.create(recipe.optimizer, model, torch.device("cpu"), dist.get_world_size(), collective=sync, sharding=sharding)


def _train(counts: Counts, optimizer: dict, comm: dict, steps: int, accum: int, sharding) -> list[dict]:
    """`steps` steps of `accum` micro-batches through Trainer.train_step: per step its kind, what each
    micro-batch sent and how many buckets had started their rounds after each backward."""
    from zoa_train.train.loss_scaling import LossScaler
    from zoa_train.train.trainer import Trainer

    recipe, model, opt = _build(optimizer, comm, accum, sharding)
    counts.count_ledger(opt.ledger)
    counts.count_calls()
    counts.map_sockets()
    inner = opt.optimizer  # a bucketed self-syncing optimizer's _next_span: the buckets whose round has started
    marks, started = [], []

    def loss(module, batch):  # at each micro-batch's forward: what the ones before sent is counted first
        if marks:
            started.append(getattr(inner, "_next_span", 0))
        marks.append(counts.snapshot())
        x, y = batch
        return torch.nn.functional.mse_loss(module(x), y)

    def skip(loss_sum) -> bool:  # after the last backward, before step(): fp32, no step skipped
        started.append(getattr(inner, "_next_span", 0))
        return False

    records = []
    for step in range(steps):
        generator = torch.Generator().manual_seed(1000 * step + counts.rank)
        batches = [(torch.randn(4, WIDTH, generator=generator), torch.randn(4, WIDTH, generator=generator)) for _ in range(accum)]
        trainer = SimpleNamespace(
            recipe=recipe,
            model=model,
            device=torch.device("cpu"),
            accum=accum,
            opt=opt,
            task=SimpleNamespace(loss=loss),
            batches=iter(batches),
            scaler=LossScaler(False),
            _skip=skip,
            params=[p for p in model.parameters() if p.requires_grad],
            scheduler=SimpleNamespace(step=lambda: None),
            _survive=lambda fn, undo=False: fn(),  # the trainer's collectives, without train.elastic live
        )
        marks.clear()
        started.clear()
        _, _, kind = Trainer.train_step(trainer)
        marks.append(counts.snapshot())
        records.append({"kind": kind, "micro": [_difference(b, a) for a, b in zip(marks, marks[1:])], "started": list(started)})
    counts.check_no_socket_opened()
    return records


def _every_path(rank, world_size):
    from zoa_train.comm.sharding import node_sharding

    before = set(_tcp_sockets())
    quiet = dist.new_group(backend="gloo")  # the counts' own barriers
    counts = Counts(quiet, set(_tcp_sockets()) - before)
    sharding = node_sharding(2)  # comm.shard node's groups, made once as by the trainer
    results = {name: {accum: _train(counts, optimizer, comm, steps, accum, sharding) for accum in (ACCUM, 1)} for name, optimizer, comm, steps in CASES}
    dist.barrier()
    return results


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_every_path, 4, sharded=True)


def _between_nodes(sent: dict) -> dict:
    """What crossed between nodes: the counts of link "inter", and any through the rendezvous store (held to none)."""
    return {key: n for key, n in sent.items() if key[1] in ("inter", "store")}


def _within(sent: dict) -> dict:
    return {key: n for key, n in sent.items() if key[1] == "intra"}


def _runs(ranks):
    """(rank, case name, comm section, step number, that step with ACCUM micro-batches, with 1)."""
    for rank, results in enumerate(ranks):
        for name, _, comm, _ in CASES:
            for t, (step, single) in enumerate(zip(results[name][ACCUM], results[name][1])):
                yield rank, name, comm, t, step, single


@pytest.mark.slow
def test_nothing_crosses_between_nodes_until_the_last_micro_batch(ranks):
    for rank, name, comm, t, step, _ in _runs(ranks):
        assert len(step["micro"]) == ACCUM
        for micro, sent in enumerate(step["micro"][:-1]):
            assert not _between_nodes(sent), f"{name}, rank {rank}, step {t + 1}, micro-batch {micro + 1} of {ACCUM}: {_between_nodes(sent)}"
            if comm is not SHARDED:  # unsharded, nothing at all: no round (overlapped or not) has started
                assert not sent, f"{name}, rank {rank}, step {t + 1}, micro-batch {micro + 1}: {sent}"
    for name, *_ in CASES:  # and the counts see what does cross: every case sends between nodes, by every count
        for key in (("ledger", "inter", "bytes"), ("calls", "inter", "calls"), ("wire", "inter", "bytes")):
            assert sum(step["micro"][-1].get(key, 0) for results in ranks for step in results[name][ACCUM]) > 0, (name, key)


@pytest.mark.slow
def test_a_step_sends_between_nodes_exactly_what_a_step_of_one_micro_batch_sends(ranks):
    for rank, name, _, t, step, single in _runs(ranks):
        assert step["kind"] == single["kind"]
        assert _between_nodes(step["micro"][-1]) == _between_nodes(single["micro"][0]), f"{name}, rank {rank}, step {t + 1} ({step['kind']})"


@pytest.mark.slow
def test_inside_the_node_fsdp2_gathers_and_reduce_scatters_every_micro_batch_as_the_ledger_says(ranks):
    for rank, name, comm, t, step, single in _runs(ranks):
        if comm is not SHARDED:
            continue
        for sent in step["micro"] + single["micro"]:
            intra = {key[2]: n for key, n in sent.items() if key[0] == "ops" and key[1] == "intra"}
            # per unit an all-gather for forward, one for backward (resharded after forward) and a reduce-scatter: no all-reduce
            assert intra == {"ALLGATHER": 2 * UNITS, "REDUCE_SCATTER": UNITS}, f"{name}, rank {rank}, step {t + 1}: {intra}"
            # the ledger records them as 3 calls on the whole shard, each sending G - 1 = 1 shard (a ring's bytes): the
            # all-gathers' inputs (the shard) and half the reduce-scatter's (the whole gradient)
            gathered, scattered = sent[("op_bytes", "intra", "ALLGATHER")], sent[("op_bytes", "intra", "REDUCE_SCATTER")]
            assert sent[("ledger", "intra", "calls")] == 3 and sent[("ledger", "intra", "bytes")] == gathered + scattered // 2, (name, sent)
            assert sent[("wire", "intra", "bytes")] >= gathered + scattered // 2
        # the same inside the node on every micro-batch
        assert all(_within(sent) == _within(single["micro"][0]) for sent in step["micro"]), (name, rank, t)


@pytest.mark.slow
def test_overlapped_rounds_start_in_the_last_backward_only(ranks):
    for rank, name, comm, t, step, _ in _runs(ranks):
        *before_last, after_last = step["started"]
        assert before_last == [0] * (ACCUM - 1), f"{name}, rank {rank}, step {t + 1}: rounds started in a micro-batch before the last"
        if comm is OVERLAPPED and step["micro"][-1].get(("calls", "inter", "calls")):
            assert after_last > 0, f"{name}, rank {rank}, step {t + 1}: no round started during the last backward"
        if comm is not OVERLAPPED:
            assert after_last == 0


@pytest.mark.slow
def test_the_ledger_counts_the_calls_between_nodes(ranks):
    for rank, name, _, t, step, _ in _runs(ranks):
        sent = step["micro"][-1]
        ledger, calls = sent.get(("ledger", "inter", "calls"), 0), sent.get(("calls", "inter", "calls"), 0)
        if name.startswith("adam"):
            # one record per step for DDP's allreduce (a call per bucket: one here) and HSDP's (one per FSDP2 unit);
            # DDP's rebuild of its buckets after the first step (two broadcasts) is not recorded
            per_step = UNITS if "HSDP" in name else 1
            assert (ledger, calls) == (1, per_step + (2 if name == "adam (DDP)" and t == 0 else 0)), (name, rank, t, ledger, calls)
        else:
            assert ledger == calls, f"{name}, rank {rank}, step {t + 1}: the ledger records {ledger} calls between nodes, {calls} were made"
