"""`zoa-train bench netsim`: train each optimizer on ranks joined by an emulated network, same recipe and seed.
(Just over 600 lines: the namespaces, links and ranks it makes are torn down by the same command that
made them, so their set-up, the runs and the summary stay together.)

Topology (all of it private to this invocation, nothing is added to the root namespace):

    namespace <prefix>-n0: ranks 0..G-1, veth <prefix>-v0, 10.231.0.1/24 ─┐
    namespace <prefix>-n1: ranks G..2G-1, veth <prefix>-v1, 10.231.0.2/24 ─┼─ ports <prefix>-p0, -p1, ... on
    ...                                                                   ┘   bridge <prefix>-br in namespace <prefix>-br

Each namespace is one node of G ranks (`--nodes N --ranks-per-node G`; `--ranks R` is R nodes of one
rank). A node's ranks share its address, so what they send each other stays on the namespace's
loopback (shaped to --intra-bandwidth, the node's total, when given) and only what goes to another
node crosses its veth. <prefix> is "zn<pid>", so two invocations never share a name, and the
addresses can be the same in every invocation because each one's namespaces see only their own
bridge. Both ends of every link are shaped to --bandwidth (the node's end limits what it sends, the
bridge port what it receives); the node's end also delays by --latency (netem), so a message between
two nodes takes one latency and a round trip two.

Each rank is `ip netns exec <ns> env RANK=... python -m zoa_train.cli run ...`: the trainer joins
as a torchrun-style rank with Gloo bound to its node's veth, and with G > 1 the recipe's
comm.ranks_per_node tells it the nodes (they all share this machine's hostname). The 1-bit
optimizers then train twice, with the flat and with the node-aware sync. `bench comm` is run over the
same links the same way. Whatever happens (a failing rank, an exception, Ctrl-C, SIGTERM), the rank
process groups are killed and every namespace of this invocation is deleted, which removes its veths
and bridge.
"""

import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from zoa_train.comm import registry as collectives
from zoa_train.errors import UserError
from zoa_train.files import dumps_json, make_directory
from zoa_train.optim import registry
from zoa_train.plan.model import Cluster, allreduce_cost, flat_onebit_cost
from zoa_train.plan.table import optimizer_table
from zoa_train.plan.units import format_bytes, parse_bandwidth, parse_latency
from zoa_train.runs import RunLog, first_reaching, mean_step_seconds, read_run, step_seconds_by_kind
from zoa_train.step_kinds import FULL, LOCAL, ONEBIT

SUBNET = "10.231.0"  # rank r is SUBNET.(r+1)/24, only ever inside this invocation's namespaces
MASTER_PORT = 29500  # free in a fresh namespace; each run adds its index so no run meets the last one's TIME_WAIT
COMM_REPEATS = 5
MAX_RANKS = 64  # one /24 and a machine's worth of processes
# tbf's bucket holds 5 ms of the rate in a 32-bit byte count (tc refuses more than 4 GiB): 1 Tbit/s fits,
# and is beyond what a veth pair moves anyway.
MAX_RATE_BITS = 10**12
MAX_LATENCY_S = 10.0  # each collective waits for it several times: beyond, a step takes minutes
IFNAMSIZ = 15  # Linux interface names are at most 15 characters


class RankFailed(Exception):
    """A rank process exited with an error: the message names it and its log (the CLI exits 1)."""


# ---- pure parts: names, addresses, tc arguments, what to compute -----------------------------------


@dataclass(frozen=True)
class Topology:
    prefix: str
    nodes: int
    ranks_per_node: int = 1

    @property
    def ranks(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def bridge_ns(self) -> str:
        return f"{self.prefix}-br"

    @property
    def bridge(self) -> str:
        return f"{self.prefix}-br"

    def node_ns(self, node: int) -> str:
        return f"{self.prefix}-n{node}"

    def node_if(self, node: int) -> str:
        return f"{self.prefix}-v{node}"

    def port_if(self, node: int) -> str:
        return f"{self.prefix}-p{node}"

    def node_address(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def rank_ns(self, rank: int) -> str:
        return self.node_ns(rank // self.ranks_per_node)

    def rank_if(self, rank: int) -> str:
        return self.node_if(rank // self.ranks_per_node)

    def address(self, rank: int) -> str:
        return self.node_address(rank // self.ranks_per_node)

    @property
    def namespaces(self) -> list[str]:
        return [self.bridge_ns, *(self.node_ns(n) for n in range(self.nodes))]


def topology(nodes: int, ranks_per_node: int = 1, pid: int | None = None) -> Topology:
    """Names for this process (pid-based: unique among live invocations): `nodes` namespaces of
    `ranks_per_node` ranks each."""
    option = "--ranks" if ranks_per_node == 1 else "--nodes"
    if not 2 <= nodes <= MAX_RANKS:
        raise UserError(f"{option} must be between 2 and {MAX_RANKS}, not {nodes}.")
    if not 1 <= ranks_per_node or nodes * ranks_per_node > MAX_RANKS:
        raise UserError(f"--ranks-per-node must be at least 1 and --nodes x --ranks-per-node at most {MAX_RANKS}, not {nodes} x {ranks_per_node}.")
    topo = Topology(f"zn{os.getpid() if pid is None else pid}", nodes, ranks_per_node)
    longest = max([topo.bridge, topo.node_if(nodes - 1), topo.port_if(nodes - 1), topo.node_ns(nodes - 1)], key=len)
    assert len(longest) <= IFNAMSIZ, longest  # pids have at most 7 digits (pid_max <= 4194304)
    return topo


def tc_rate(bandwidth: str) -> int:
    """--bandwidth (e.g. 100mbit, 1Gbit, 12.5MB/s) in bits/s, as tc takes it."""
    return round(parse_bandwidth(bandwidth) * 8)


def parse_optimizers(text: str) -> list[str]:
    """Comma-separated optimizer names, Adam first (its final val_loss is everyone's target); 'none': no
    training; 'all': every registered optimizer (a recipe's imports included, once it has been loaded)."""
    if text.strip() == "none":
        return []
    known = registry.names()
    names = list(known) if text.strip() == "all" else [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise UserError(f"--optimizers takes all, none or a comma-separated list of {', '.join(known)}, not {text!r}.")
    if len(set(names)) != len(names):
        raise UserError(f"--optimizers names an optimizer twice: {text!r}.")
    return sorted(names, key=lambda n: n != registry.BASELINE)


def parse_variants(texts: list[str]) -> list[tuple[str, str, list[str]]]:
    """--variant NAME:section.key=value[,section.key=value] (repeatable): (label, optimizer, recipe values)
    of each extra run of an optimizer with values of its own, labelled NAME+key=value."""
    variants = []
    for text in texts:
        name, _, pairs = text.partition(":")
        sets = [p.strip() for p in pairs.split(",") if p.strip()]
        if name.strip() not in registry.names() or not sets or not all("=" in s and "." in s.partition("=")[0] for s in sets):
            raise UserError(
                f"--variant takes NAME:section.key=value[,section.key=value] with NAME one of {', '.join(registry.names())}, "
                f"e.g. zero_one_adam:optimizer.sync_delay=1, not {text!r}."
            )
        label = "+".join([name.strip(), *(s.partition("=")[0].rpartition(".")[2] + "=" + s.partition("=")[2] for s in sets)])
        variants.append((label, name.strip(), sets))
    if len({label for label, _, _ in variants}) != len(variants):
        raise UserError(f"--variant names the same run twice: {', '.join(texts)}.")
    return variants


def link_commands(topo: Topology, rate_bits: int, latency_s: float, intra_bits: int = 0) -> list[list[str]]:
    """The ip/tc commands that build the network, in order; nothing runs in the root namespace.
    `intra_bits`: the rate of each node's loopback, which its ranks share (0: unshaped)."""
    rate = f"{rate_bits}bit"
    # tbf's bucket: at least 128 KiB (a 64 KiB GSO packet must fit, or tbf drops it) and 5 ms of the rate,
    # so high rates need not wake the timer for every packet; the queue holds 100 ms before dropping.
    burst = str(max(128 * 1024, rate_bits // 8 // 200))
    tbf = ["tbf", "rate", rate, "burst", burst, "latency", "100ms"]
    # netem does rate and delay in one qdisc; its limit (packets) must cover the bytes in flight.
    netem = ["netem", "delay", f"{round(latency_s * 1e6)}us", "rate", rate, "limit", "100000"]
    b = topo.bridge_ns
    commands = [["ip", "netns", "add", ns] for ns in topo.namespaces]
    commands += [
        ["ip", "-n", b, "link", "add", topo.bridge, "type", "bridge"],
        ["ip", "-n", b, "link", "set", topo.bridge, "up"],
    ]
    for node in range(topo.nodes):
        ns, veth, port = topo.node_ns(node), topo.node_if(node), topo.port_if(node)
        commands += [
            # Created directly inside the two namespaces: the pair never exists in the root namespace.
            ["ip", "link", "add", veth, "netns", ns, "type", "veth", "peer", "name", port, "netns", b],
            ["ip", "-n", b, "link", "set", port, "master", topo.bridge],
            ["ip", "-n", b, "link", "set", port, "up"],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
            ["ip", "-n", ns, "addr", "add", f"{topo.node_address(node)}/24", "dev", veth],
            ["ip", "-n", ns, "link", "set", veth, "up"],
            ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", veth, "root", *(netem if latency_s > 0 else tbf)],
            ["ip", "netns", "exec", b, "tc", "qdisc", "add", "dev", port, "root", *tbf],
        ]
        if intra_bits and topo.ranks_per_node > 1:
            loopback = ["tbf", "rate", f"{intra_bits}bit", "burst", str(max(128 * 1024, intra_bits // 8 // 200)), "latency", "100ms"]
            commands.append(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", *loopback])
    return commands


def rank_command(topo: Topology, rank: int, port: int, argv: list[str]) -> list[str]:
    """`python -m zoa_train.cli ARGV` as rank `rank` of a torchrun-style group inside its namespace."""
    env = {
        "RANK": rank, "WORLD_SIZE": topo.ranks, "LOCAL_RANK": rank % topo.ranks_per_node, "LOCAL_WORLD_SIZE": topo.ranks_per_node,
        "MASTER_ADDR": topo.address(0), "MASTER_PORT": port,
        "OMP_NUM_THREADS": 1,  # ranks share this machine's cores
        "GLOO_SOCKET_IFNAME": topo.rank_if(rank),
    }  # fmt: skip
    return ["ip", "netns", "exec", topo.rank_ns(rank), "env", *(f"{k}={v}" for k, v in env.items()),
            sys.executable, "-m", "zoa_train.cli", *argv]  # fmt: skip


def median_step_time(records: list[dict]) -> float:
    """Median seconds per step between consecutive metric records (wall_time and step differences).
    The first record's interval holds start-up work and is used only when it is the only one."""
    timed = [r for r in records if "wall_time" in r]
    if len(timed) == 1:
        return timed[0]["wall_time"] / timed[0]["step"]
    return statistics.median((b["wall_time"] - a["wall_time"]) / (b["step"] - a["step"]) for a, b in zip(timed, timed[1:]))


def speedup(baseline: float | None, value: float | None) -> float | None:
    """baseline / value (how many times faster than the baseline), None when either is unknown."""
    if baseline is None or value is None or value <= 0:
        return None
    return baseline / value


def summarize(run: RunLog, target: float | None) -> dict:
    """One optimizer's figures from its run directory; time to target via zoa_train.runs.first_reaching."""
    records = run.series("wall_time")
    if not records:
        raise RankFailed(f"{run.path}/metrics.jsonl has no records.")
    last = records[-1]
    hit = first_reaching(run, target) if target is not None else None
    rate = next(k for k in last if k.endswith("_per_s"))  # tokens_per_s, images_per_s: the task's unit
    return {
        "optimizer": run.optimizer,
        "run_dir": str(run.path),
        "steps": last["step"],
        "median_step_s": median_step_time(records),
        "mean_step_s": mean_step_seconds(run.records),  # training alone, what plan --step-time predicts
        "step_s_by_kind": step_seconds_by_kind(run.records),
        # bucketed rounds (comm.bucket_cap_mb): their seconds per step, and what step() waited of them
        "comm_s_by_kind": step_seconds_by_kind(run.records, "comm_s"),
        "comm_exposed_s_by_kind": step_seconds_by_kind(run.records, "comm_exposed_s"),
        rate: statistics.median(r[rate] for r in records if rate in r),  # validation-only records have none
        "bits_per_param": last["bits_per_param"],
        "rounds": last["rounds"],
        "bytes_sent_per_rank": last["bytes_sent"],  # rank 0's ledger: what the optimizer sent
        "final_loss": last["loss"],
        "final_val_loss": run.final("val_loss"),
        "wall_time_s": last["wall_time"],
        "time_to_target_s": hit["wall_time"] if hit else None,
        "step_to_target": hit["step"] if hit else None,
    }


def add_speedups(rows: list[dict]) -> None:
    """Speed-ups against Adam's row (none without one): total training wall time and time to target."""
    base = next((r for r in rows if r["optimizer"] == registry.BASELINE), None)
    for row in rows:
        row["speedup_wall"] = speedup(base["wall_time_s"], row["wall_time_s"]) if base else None
        row["speedup_time_to_target"] = speedup(base["time_to_target_s"], row["time_to_target_s"]) if base else None


def plan_inputs(result: dict, num_params: int, element_size: int) -> dict | None:
    """`plan`'s --step-time, --compress-rate and --reduce-rate (and --fsdp-rate, when sharded 0/1 Adam
    trained: what its local step adds to the flat one) as this run measured them (docs/algorithm.md,
    "Calibrating on a machine"): 0/1 Adam's local step is the compute; 1-bit Adam's 1-bit and
    full-precision steps, less it and their transfer as plan models it over these links, are the work on
    the ranks. None unless the run trained both optimizers flat; a rate is None where that work came out
    at or below zero (a slow link whose transfer the model overestimates, or noise). Meant for a fast link,
    where the transfer is a small part of the step."""
    kinds = {(r["optimizer"], r["topology"] or "flat"): r["step_s_by_kind"] for r in result["runs"]}
    compute = kinds.get(("zero_one_adam", "flat"), {}).get(LOCAL)
    onebit = kinds.get(("onebit_adam", "flat"), {})
    if compute is None or ONEBIT not in onebit or FULL not in onebit:
        return None
    intra = parse_bandwidth(result["intra_bandwidth"]) if result.get("intra_bandwidth") else float("inf")
    cluster = Cluster(result["nodes"], result["ranks_per_node"], result["bandwidth_bits_per_s"] / 8, result["latency_s"], intra, "gloo")
    encoding = onebit[ONEBIT] - compute - flat_onebit_cost(num_params, cluster).seconds
    full = allreduce_cost(num_params, element_size, cluster)
    reducing = onebit[FULL] - compute - full.seconds
    sent = full.bytes_per_rank / element_size  # the elements each rank sends in the ring: what --reduce-rate counts
    inputs = {
        "step_time_s": compute,
        "compress_rate": num_params / encoding if encoding > 0 else None,
        "reduce_rate": sent / reducing if reducing > 0 else None,
    }
    sharded = kinds.get(("zero_one_adam", "sharded"), {}).get(LOCAL)
    if sharded is not None:  # FSDP2's gathers and reduce-scatter are all a sharded local step adds (--fsdp-rate)
        g = result["ranks_per_node"]
        moved = 3 * (g - 1) * -(-num_params // g)  # elements a rank sends in them per micro-batch, as plan counts
        inputs["fsdp_rate"] = moved / (sharded - compute) if sharded > compute else None
    return inputs


# ---- the machine: network, rank processes -----------------------------------------------------------


def check_prerequisites() -> None:
    if os.geteuid() != 0:
        raise UserError("bench netsim needs root to create network namespaces: run it with sudo.")
    if not (shutil.which("ip") and shutil.which("tc")):
        raise UserError("bench netsim needs the ip and tc commands: install iproute2 (apt-get install iproute2).")


def _run_ip(command: list[str]) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode == 0:
        return done
    why = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit code {done.returncode}"
    if "netem" in command and "unknown" in why:
        raise UserError("--latency needs the netem qdisc, which this kernel lacks (CONFIG_NET_SCH_NETEM): pass --latency 0 to shape the bandwidth only.")
    if command[:3] == ["ip", "netns", "add"]:
        raise UserError(f"bench netsim cannot create a network namespace ({why}): it needs root with CAP_SYS_ADMIN and CAP_NET_ADMIN.")
    raise UserError(f"setting up the emulated network failed at `{' '.join(command)}`: {why}.")


def remove_namespaces(prefix: str) -> None:
    """Delete every namespace named <prefix>-*; their veths and bridge go with them."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in listed.splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(prefix + "-"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


@contextmanager
def emulated_network(topo: Topology, rate_bits: int, latency_s: float, intra_bits: int = 0) -> Iterator[None]:
    """Build the namespaces, bridge and shaped veths; delete them on the way out, however it is left."""
    try:
        # Namespaces with this pid's prefix can only be left over from a dead process that had our pid.
        remove_namespaces(topo.prefix)
        for command in link_commands(topo, rate_bits, latency_s, intra_bits):
            _run_ip(command)
        yield
    finally:
        with _signals_blocked():  # a second Ctrl-C must not stop the clean-up half-way
            remove_namespaces(topo.prefix)


@contextmanager
def _signals_blocked() -> Iterator[None]:
    blocked = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked)


@contextmanager
def terminate_as_exit() -> Iterator[None]:
    """Turn SIGTERM into SystemExit(143), so the finally blocks run as they do for Ctrl-C (KeyboardInterrupt)."""

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def tx_bytes(topo: Topology, node: int) -> int:
    """Bytes node `node` has put on its link to the others (its veth's transmit counter: headers and
    start-up included; its ranks' traffic with each other stays on its loopback)."""
    out = _run_ip(["ip", "-n", topo.node_ns(node), "-s", "-j", "link", "show", "dev", topo.node_if(node)]).stdout
    return json.loads(out)[0]["stats64"]["tx"]["bytes"]


def _kill_groups(procs: list[subprocess.Popen]) -> None:
    """SIGTERM each rank's process group (each rank leads its own session), SIGKILL what is left after 5 s."""
    for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        for p in procs:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        if all(p.poll() is not None for p in procs):
            return


def run_ranks(label: str, commands: list[list[str]], logs: list[Path]) -> None:
    """Run one process per rank until all succeed; the first failure kills the others (which would
    otherwise wait in a collective) and raises RankFailed naming the rank and its log."""
    procs = []
    try:
        for command, log in zip(commands, logs):
            with open(log, "w") as f:
                procs.append(subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, start_new_session=True))
        while True:
            codes = [p.poll() for p in procs]
            failed = next(((r, c) for r, c in enumerate(codes) if c not in (None, 0)), None)
            if failed:
                rank, code = failed
                raise RankFailed(f"{label}: rank {rank} exited with code {code}: {_last_line(logs[rank])} (log: {logs[rank]}).")
            if all(c == 0 for c in codes):
                return
            time.sleep(0.1)
    finally:
        with _signals_blocked():
            _kill_groups(procs)


def _last_line(log: Path) -> str:
    """What the rank died of: from its log's last "error: ..." (the CLI's) or "SomethingError: ..." line
    to the end (a long message wraps onto more lines), without torch's "[rank0]: " in front."""
    lines = [re.sub(r"^\[rank\d+\]: ", "", line).strip() for line in log.read_text(errors="replace").splitlines()]
    lines = [line for line in lines if line]
    if not lines:
        return "no output"
    starts = [i for i, line in enumerate(lines) if re.match(r"error: |[\w.]*(Error|Exception|Interrupt)\b", line)]
    text = " ".join(lines[starts[-1] if starts else -1 :])
    return text.removeprefix("error: ").rstrip(".")[:500]


# ---- the benchmark ------------------------------------------------------------------------------------


def prepare_run_dir(path: Path) -> None:
    """Empty a previous run directory: under a launcher, `run` appends to metrics.jsonl instead of refusing.
    Anything that does not look like a run directory is left alone."""
    if path.exists() and any(path.iterdir()):
        if not ((path / "metrics.jsonl").exists() or (path / "recipe.yaml").exists()):
            raise UserError(f"{path} exists and is not a run directory: choose another --out.")
        shutil.rmtree(path)
    make_directory(path, "run directory")


def run_netsim(
    recipe: Path,
    overrides: list[str],
    optimizers: list[str],
    ranks: int,
    bandwidth: str,
    latency: str,
    out: Path,
    comm_sizes: list[int],
    progress=print,
    margin: float = 0.0,
    ranks_per_node: int = 1,
    intra_bandwidth: str = "",
    num_params: int = 0,
    target_loss: float | None = None,
    shard: bool = False,
    variants: list[tuple[str, str, list[str]]] = (),
) -> dict:
    """Train each optimizer over the emulated network (`ranks` in nodes of `ranks_per_node`), then run
    bench comm over it; returns (and writes to OUT/netsim.json) the figures, with `num_params` (the
    model's) also `plan`'s inputs where the run gives them (plan_inputs). Inputs are checked before
    anything is created. `target_loss` stands in for Adam's final val_loss where Adam is not trained here
    (a link too slow to train it on: the loss a seed reaches does not depend on the link). `shard`: each
    optimizer that can be is also trained sharded inside the node (comm.shard node), labelled NAME-sharded.
    `variants` (parse_variants): more runs of an optimizer with recipe values of their own, after the others."""
    from zoa_train.config import check_batch_layout, load_recipe

    if target_loss is not None and registry.BASELINE in optimizers:
        raise UserError(f"--target-loss stands in for {registry.BASELINE}'s run: drop {registry.BASELINE} from --optimizers, or drop --target-loss.")
    if ranks_per_node < 1 or ranks % ranks_per_node:
        raise UserError(f"--ranks-per-node must divide the {ranks} ranks, not {ranks_per_node}.")
    topo = topology(ranks // ranks_per_node, ranks_per_node)
    rate_bits, latency_s = tc_rate(bandwidth), parse_latency(latency)
    intra_bits = tc_rate(intra_bandwidth) if intra_bandwidth else 0
    for option, text, bits in (("--bandwidth", bandwidth, rate_bits), ("--intra-bandwidth", intra_bandwidth, intra_bits)):
        if bits > MAX_RATE_BITS:
            raise UserError(f"{option} {text} is more than the 1 Tbit/s an emulated link can be given; pass a lower rate.")
    if latency_s > MAX_LATENCY_S:
        raise UserError(f"--latency {latency} is more than the {MAX_LATENCY_S:g} s an emulated link can be given; pass a shorter delay.")
    load_recipe(recipe, overrides)  # its imports first: the collectives they register are raced too
    runs = {}  # label -> (optimizer, overrides); the 1-bit optimizers on several nodes of several ranks: one per collective
    nodes = [f"comm.ranks_per_node={ranks_per_node}"] if ranks_per_node > 1 else []
    for name in optimizers:
        if registry.get(name).uses_collective and ranks_per_node > 1:
            for kind in collectives.names():  # a run per registered collective (zoa_train/comm/registry.py)
                runs[f"{name}-{kind}"] = (name, kind, [*overrides, *nodes, f"comm.topology={kind}", f"optimizer.name={name}"])
        else:
            runs[name] = (name, None, [*overrides, *nodes, f"optimizer.name={name}"])
        if shard and registry.get(name).shardable:  # sharded inside each node, the shard between nodes
            runs[f"{name}-sharded"] = (name, "sharded", [*overrides, *nodes, "comm.shard=node", f"optimizer.name={name}"])
    for label, name, sets in variants:
        if label in runs:
            raise UserError(f"--variant {label} is also a run of --optimizers; give it other values.")
        runs[label] = (name, label.partition("+")[2], [*overrides, *nodes, *sets, f"optimizer.name={name}"])  # its values in the column's title
    for _, _, sets in runs.values():
        check_batch_layout(load_recipe(recipe, sets), ranks, str(recipe))
    check_prerequisites()
    out = out.resolve()
    for label in runs:
        prepare_run_dir(out / label)
    make_directory(out / "logs", "--out")

    result = {
        "ranks": ranks, "nodes": topo.nodes, "ranks_per_node": ranks_per_node, "bandwidth": bandwidth, "bandwidth_bits_per_s": rate_bits,
        "intra_bandwidth": intra_bandwidth or None, "latency_s": latency_s, "recipe": str(recipe), "overrides": overrides, "prefix": topo.prefix,
    }  # fmt: skip
    rows, comm = [], None
    with terminate_as_exit(), emulated_network(topo, rate_bits, latency_s, intra_bits):
        for index, (label, (name, kind, sets)) in enumerate(runs.items()):
            progress(f"{label}: training on {topo.nodes} nodes x {ranks_per_node} ranks, logs in {out / 'logs'}")
            argv = ["run", str(recipe.resolve()), "--out", str(out / label), "--overwrite", *(a for s in sets for a in ("--set", s))]
            before = [tx_bytes(topo, n) for n in range(topo.nodes)]
            run_ranks(label, [rank_command(topo, r, MASTER_PORT + index, argv) for r in range(ranks)],
                      [out / "logs" / f"{label}-rank{r}.log" for r in range(ranks)])  # fmt: skip
            per_node = statistics.mean(tx_bytes(topo, n) - b for n, b in enumerate(before))
            rows.append(
                {"label": label, "optimizer": name, "topology": kind, "wire_bytes_per_node": per_node, "wire_bytes_per_rank": per_node / ranks_per_node}
            )
        if comm_sizes:
            progress(f"bench comm: fp32 vs 1-bit allreduce of {', '.join(map(str, comm_sizes))} elements")
            argv = ["bench", "comm", "--backend", "gloo", "--sizes", ",".join(map(str, comm_sizes)), "--repeats", str(COMM_REPEATS), "--json"]
            if ranks_per_node > 1:
                argv += ["--ranks-per-node", str(ranks_per_node)]
            logs = [out / "logs" / f"comm-rank{r}.log" for r in range(ranks)]
            run_ranks("bench comm", [rank_command(topo, r, MASTER_PORT + len(runs), argv) for r in range(ranks)], logs)
            comm = _last_json(logs[0])

    logs = {label: read_run(out / label) for label in runs}
    adam, target = reference_loss(logs, margin, target_loss)
    rows = [summarize(logs[row["label"]], target) | row for row in rows]
    add_speedups(rows)
    result |= {"adam_val_loss": adam, "target_given": target_loss is not None, "target_margin": margin, "target_val_loss": target, "runs": rows, "comm": comm}
    if num_params:
        element_size = 4 if load_recipe(recipe, overrides).optimizer.allreduce_dtype == "fp32" else 2
        result["plan_inputs"] = plan_inputs(result, num_params, element_size)
    (out / "netsim.json").write_text(dumps_json(result, indent=1) + "\n")
    return result


def reference_loss(logs: dict[str, RunLog], margin: float, given: float | None) -> tuple[float | None, float | None]:
    """Adam's final val_loss among the runs' `logs`, or `given` (--target-loss) where Adam was not
    trained; and the target, that times 1 + `margin` (None, None: no Adam run and nothing given)."""
    adam = logs[registry.BASELINE].final("val_loss") if registry.BASELINE in logs else given
    return adam, (adam * (1 + margin) if adam is not None else None)


def _last_json(log: Path) -> dict:
    """The JSON object rank 0 of `bench comm --json` printed last."""
    for line in reversed(log.read_text(errors="replace").splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RankFailed(f"bench comm printed no JSON (log: {log}).")


# ---- the table ------------------------------------------------------------------------------------------


def _times(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _round_times(row: dict) -> str:
    """A 1-bit step's bucketed rounds (fitted): the seconds step() waited for them / the seconds they took."""
    took, waited = row.get("comm_s_by_kind", {}).get(ONEBIT), row.get("comm_exposed_s_by_kind", {}).get(ONEBIT)
    return "-" if took is None or waited is None else f"{waited * 1e3:.0f} / {took * 1e3:.0f} ms"


def format_netsim(result: dict):
    """The optimizers side by side, then the bench comm rows, for the CLI to print."""
    from rich.console import Group
    from rich.table import Table

    latency = f"{result['latency_s'] * 1e3:g} ms latency" if result["latency_s"] else "no added latency"
    parts = []
    rows = result["runs"]
    if rows:
        target = result["target_val_loss"]
        shape = f"{result['nodes']} nodes x {result['ranks_per_node']} ranks" if result.get("ranks_per_node", 1) > 1 else f"{result['ranks']} ranks"
        title = f"{result['recipe']} on {shape}, {result['bandwidth']} links, {latency}"
        margin = f" + {result['target_margin']:.1%}" if result.get("target_margin") else ""
        wire = "bytes sent: the optimizer's count, on the wire: the veth's"
        if target is None:
            caption = "no Adam run: no target, no speed-ups"
        elif result.get("target_given"):
            caption = f"target: --target-loss{margin}, {target:.4f}; no Adam run: no speed-ups; {wire}"
        else:
            caption = f"target: Adam's final val_loss{margin}, {target:.4f}; speed-ups against Adam; {wire}"

        def reached(r):
            return "not reached" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f} s (step {r['step_to_target']})"

        lines = [
            ("steps", lambda r: f"{r['steps']:,}"),
            ("median step time", lambda r: f"{r['median_step_s'] * 1e3:.0f} ms"),
            ("throughput", lambda r: next(f"{v:,.0f} {k.removesuffix('_per_s')}/s" for k, v in r.items() if k.endswith("_per_s"))),
            ("bits / param / step", lambda r: f"{r['bits_per_param']:.3f}"),
            ("rounds", lambda r: f"{r['rounds']:,}"),
            ("bytes sent / rank", lambda r: format_bytes(r["bytes_sent_per_rank"])),
            ("bytes on the wire / rank", lambda r: format_bytes(r["wire_bytes_per_rank"])),
            ("bytes between nodes / node", lambda r: format_bytes(r["wire_bytes_per_node"])),
            ("1-bit round: waited in step() / took", _round_times),
            ("final val_loss", lambda r: "-" if r["final_val_loss"] is None else f"{r['final_val_loss']:.4f}"),
            ("wall time", lambda r: f"{r['wall_time_s']:.1f} s"),
            ("time to target", reached),
            ("speed-up: wall time", lambda r: _times(r["speedup_wall"])),
            ("speed-up: time to target", lambda r: _times(r["speedup_time_to_target"])),
        ]
        columns = [(r["optimizer"], r, r["topology"]) for r in rows]
        parts.append(optimizer_table(title, caption, columns, lines))
    if result["comm"]:
        table = Table(title=f"bench comm over the same links: fp32 vs 1-bit allreduce, median of {result['comm']['repeats']}")
        for name in ("elements", "fp32 s", "bf16 s", "1-bit s", "speed-up", "fp32 bytes / rank", "1-bit bytes / rank"):
            table.add_column(name, justify="right")
        for r in result["comm"]["results"]:
            table.add_row(f"{r['numel']:,}", f"{r['allreduce_fp32_s']:.4f}", f"{r['allreduce_bf16_s']:.4f}", f"{r['onebit_s']:.4f}", f"{r['speedup']:.2f}x",
                          format_bytes(r["fp32_bytes_per_rank"]), format_bytes(r["onebit_bytes_per_rank"]))  # fmt: skip
        parts.append(table)
        rows = [r for r in result["comm"]["results"] if "node_aware_s" in r]
        if rows:
            table = Table(title=f"flat vs node-aware 1-bit allreduce over the same links, {result['nodes']} nodes x {result['ranks_per_node']} ranks, per call")
            for name in ("elements", "flat s", "node-aware s", "node-aware vs flat", "flat between nodes / node", "node-aware between nodes / node"):
                table.add_column(name, justify="right")
            g = result["ranks_per_node"]
            for r in rows:
                table.add_row(f"{r['numel']:,}", f"{r['onebit_s']:.4f}", f"{r['node_aware_s']:.4f}", f"{r['onebit_s'] / r['node_aware_s']:.2f}x",
                              format_bytes(g * r["onebit_inter_bytes_per_rank"]), format_bytes(g * r["node_aware_inter_bytes_per_rank"]))  # fmt: skip
            parts.append(table)
    inputs = result.get("plan_inputs")
    if inputs:
        rate = lambda x: f"{x:.3g}" if x else "(none: the work came out at or below zero)"  # noqa: E731
        parts.append(
            f"plan's inputs from this run (meaningful over a fast link): --step-time {inputs['step_time_s'] * 1e3:.1f}ms "
            f"--compress-rate {rate(inputs['compress_rate'])} --reduce-rate {rate(inputs['reduce_rate'])}"
            + (f" --fsdp-rate {rate(inputs['fsdp_rate'])}" if "fsdp_rate" in inputs else "")
        )
    return Group(*parts)
