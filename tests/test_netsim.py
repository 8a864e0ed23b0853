"""bench netsim: the pure parts (names, rates, tc arguments, figures) everywhere; the emulated network itself
(namespaces, a bridge, shaped veths, real 2-rank training runs) only with root, iproute2 and namespace rights.

The network tests check that nothing of an invocation is left afterwards, after success, after a failing
rank and after Ctrl-C / SIGTERM. On a 100 Mbit/s link the fp32 allreduce of 1M elements moves 4 MB per
rank, the 1-bit one 131 kB, so the 1-bit call must win by far more than any CPU noise could hide.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import refused, zoa_here
from rich.console import Console

from zoa_train.bench import netsim
from zoa_train.errors import UserError
from zoa_train.runs import RunLog, mean_step_seconds, read_run, step_seconds_by_kind

ROOT = Path(__file__).resolve().parents[1]
FIELDS = {
    "optimizer", "run_dir", "steps", "median_step_s", "tokens_per_s", "bits_per_param", "rounds", "bytes_sent_per_rank",
    "wire_bytes_per_rank", "final_loss", "final_val_loss", "wall_time_s", "time_to_target_s", "step_to_target",
    "speedup_wall", "speedup_time_to_target", "label", "topology", "wire_bytes_per_node", "mean_step_s", "step_s_by_kind",
    "comm_s_by_kind", "comm_exposed_s_by_kind",
}  # fmt: skip


# ---- pure parts, no root needed ------------------------------------------------------------------------


def test_bandwidth_is_parsed_into_tc_bits_per_second():
    assert netsim.tc_rate("100mbit") == 100_000_000
    assert netsim.tc_rate("1Gbit") == 1_000_000_000
    assert netsim.tc_rate("12.5MB/s") == 100_000_000
    assert netsim.tc_rate("100") == 800  # plain numbers are bytes/s, as in `plan`
    for bad in ("fast", "-1Gbit", "10Gb", "0mbit"):
        with pytest.raises(UserError):
            netsim.tc_rate(bad)


def test_names_are_short_unique_per_pid_and_addresses_private():
    big = netsim.topology(64, pid=4194303)  # the largest pid Linux hands out
    names = [big.bridge, *(big.rank_if(r) for r in range(64)), *(big.port_if(r) for r in range(64))]
    assert max(map(len, names)) <= 15
    assert len(set(names) - {big.bridge}) == 128 and big.bridge_ns not in big.namespaces[1:]
    a, b = netsim.topology(2, pid=100), netsim.topology(2, pid=1000)
    assert not set(a.namespaces) & set(b.namespaces) and a.rank_if(0) != b.rank_if(0)
    assert [a.address(r) for r in range(2)] == ["10.231.0.1", "10.231.0.2"]
    assert a.prefix == "zn100" and all(ns.startswith("zn100-") for ns in a.namespaces)
    with pytest.raises(UserError, match="--ranks"):
        netsim.topology(1)


@pytest.mark.parametrize("latency", [0.0, 0.001])
def test_link_commands_stay_out_of_the_root_namespace(latency):
    topo = netsim.topology(2, pid=42)
    commands = netsim.link_commands(topo, 100_000_000, latency)
    for c in commands:
        assert c[0] == "ip"
        # each command names its namespace: -n NS, netns add/exec NS, or a veth created inside two namespaces
        assert c[1] == "-n" or c[1:3] in (["netns", "add"], ["netns", "exec"]) or c.count("netns") == 2, c
    qdiscs = {(c[3], c[c.index("dev") + 1]): c[c.index("root") + 1 :] for c in commands if "qdisc" in c}
    rank_ends = [qdiscs.pop((topo.rank_ns(r), topo.rank_if(r))) for r in range(2)]
    bridge_ports = [qdiscs.pop((topo.bridge_ns, topo.port_if(r))) for r in range(2)]
    assert not qdiscs  # both ends of both links are shaped, nothing else
    assert all(q[0] == "tbf" and "100000000bit" in q for q in bridge_ports)
    if latency:
        assert all(q[:3] == ["netem", "delay", "1000us"] and "100000000bit" in q for q in rank_ends)
    else:
        assert rank_ends == bridge_ports


def test_rank_command_describes_a_torchrun_rank_inside_its_namespace():
    topo = netsim.topology(4, pid=7)
    command = netsim.rank_command(topo, 3, 29501, ["run", "r.yaml"])
    assert command[:5] == ["ip", "netns", "exec", "zn7-n3", "env"]
    for setting in ("RANK=3", "WORLD_SIZE=4", "LOCAL_RANK=0", "LOCAL_WORLD_SIZE=1", "MASTER_ADDR=10.231.0.1",
                    "MASTER_PORT=29501", "OMP_NUM_THREADS=1", "GLOO_SOCKET_IFNAME=zn7-v3"):  # fmt: skip
        assert setting in command
    assert command[-4:] == ["-m", "zoa_train.cli", "run", "r.yaml"]


def test_nodes_of_several_ranks_share_a_namespace_and_a_shaped_loopback():
    topo = netsim.topology(2, 3, pid=7)
    assert topo.ranks == 6 and topo.namespaces == ["zn7-br", "zn7-n0", "zn7-n1"]
    command = netsim.rank_command(topo, 4, 29501, ["run", "r.yaml"])
    assert command[:5] == ["ip", "netns", "exec", "zn7-n1", "env"]
    for setting in ("RANK=4", "WORLD_SIZE=6", "LOCAL_RANK=1", "LOCAL_WORLD_SIZE=3", "MASTER_ADDR=10.231.0.1", "GLOO_SOCKET_IFNAME=zn7-v1"):
        assert setting in command
    commands = netsim.link_commands(topo, 100_000_000, 0.0, intra_bits=10_000_000_000)
    loopbacks = [c for c in commands if "qdisc" in c and c[c.index("dev") + 1] == "lo"]
    assert [c[3] for c in loopbacks] == ["zn7-n0", "zn7-n1"] and all("10000000000bit" in c for c in loopbacks)
    assert not [c for c in netsim.link_commands(topo, 100_000_000, 0.0) if "lo" in c and "qdisc" in c]  # unshaped by default
    with pytest.raises(UserError, match="--nodes must be between 2"):
        netsim.topology(1, 4)
    with pytest.raises(UserError, match="at most 64"):
        netsim.topology(8, 9)


def test_optimizers_are_checked_and_adam_runs_first():
    assert netsim.parse_optimizers("zero_one_adam,adam") == ["adam", "zero_one_adam"]
    assert netsim.parse_optimizers("onebit_adam") == ["onebit_adam"]
    assert netsim.parse_optimizers("none") == []
    for bad in ("adam,sgd", "adam,adam", ""):
        with pytest.raises(UserError, match="--optimizers"):
            netsim.parse_optimizers(bad)


def test_variants_are_checked_and_labelled_by_their_values():
    assert netsim.parse_variants(["zero_one_adam:optimizer.sync_delay=1", "diloco:optimizer.sync_every=8,optimizer.outer_lr=1"]) == [
        ("zero_one_adam+sync_delay=1", "zero_one_adam", ["optimizer.sync_delay=1"]),
        ("diloco+sync_every=8+outer_lr=1", "diloco", ["optimizer.sync_every=8", "optimizer.outer_lr=1"]),
    ]
    for bad in (["sgd:optimizer.lr=1"], ["zero_one_adam"], ["zero_one_adam:sync_delay=1"], ["adam:optimizer.lr"], ["adam:optimizer.lr=1"] * 2):
        with pytest.raises(UserError, match="--variant"):
            netsim.parse_variants(bad)


def test_step_seconds_by_kind_are_recovered_from_the_windows():
    seconds = {"v": 0.5, "s": 0.3, "l": 0.1}
    windows = ["vvvvv", "vvsvs", "vlsls", "llsll", "lllls", "ssss"]
    records = [{"step": 5 * (i + 1), "step_kinds": kinds, "train_s": sum(seconds[k] for k in kinds)} for i, kinds in enumerate(windows)]
    records[0]["train_s"] = 30.0  # start-up: left out
    records.insert(2, {"step": 10, "val_loss": 3.0})  # a validation-only record: no window
    fitted = step_seconds_by_kind(records)
    assert fitted.keys() == seconds.keys() and all(abs(fitted[k] - seconds[k]) < 1e-12 for k in seconds)
    assert abs(mean_step_seconds(records) - sum(r["train_s"] for r in records[1:] if "train_s" in r) / 24) < 1e-12
    assert step_seconds_by_kind([]) == {} and mean_step_seconds([]) is None
    waited = {"v": 0.05, "s": 0.02, "l": 0.0}  # another key: the seconds step() waited, fitted alike
    for r in records:
        if "step_kinds" in r:
            r["comm_exposed_s"] = sum(waited[k] for k in r["step_kinds"])
    fitted = step_seconds_by_kind(records, "comm_exposed_s")
    assert all(abs(fitted[k] - waited[k]) < 1e-12 for k in waited) and step_seconds_by_kind(records[:3], "comm_s") == {}


def test_plan_inputs_give_back_the_step_kinds_they_were_measured_from():
    """Compute from 0/1 Adam's local step; encoding and reduction rates from 1-bit Adam's 1-bit and
    full-precision steps: priced by plan with those rates, the two steps come out as measured."""
    from zoa_train.plan.model import Cluster, allreduce_cost, flat_onebit_cost

    numel, compute = 1_000_000, 0.15
    result = {"nodes": 2, "ranks_per_node": 2, "bandwidth_bits_per_s": 10**8, "latency_s": 0.0, "intra_bandwidth": None}
    cluster = Cluster(2, 2, 10**8 / 8, 0.0, float("inf"), "gloo")
    full_step = compute + 0.06 + allreduce_cost(numel, 2, cluster).seconds
    onebit_step = compute + 0.05 + flat_onebit_cost(numel, cluster).seconds
    result["runs"] = [
        {"optimizer": "adam", "topology": None, "step_s_by_kind": {"f": 0.4}},
        {"optimizer": "onebit_adam", "topology": "flat", "step_s_by_kind": {"f": full_step, "s": onebit_step}},
        {"optimizer": "onebit_adam", "topology": "hierarchical", "step_s_by_kind": {"f": 9.0, "s": 9.0}},
        {"optimizer": "zero_one_adam", "topology": "flat", "step_s_by_kind": {"v": 0.5, "s": 0.3, "l": compute}},
    ]
    inputs = netsim.plan_inputs(result, numel, 2)
    assert inputs["step_time_s"] == compute and inputs["compress_rate"] == pytest.approx(numel / 0.05)
    assert compute + allreduce_cost(numel, 2, cluster, inputs["reduce_rate"]).seconds == pytest.approx(full_step)
    assert compute + flat_onebit_cost(numel, cluster, inputs["compress_rate"]).seconds == pytest.approx(onebit_step)
    result["runs"][1]["step_s_by_kind"]["s"] = compute  # no time left for encoding: no rate
    assert netsim.plan_inputs(result, numel, 2)["compress_rate"] is None
    assert netsim.plan_inputs({**result, "runs": result["runs"][:3]}, numel, 2) is None  # no 0/1 Adam
    assert "fsdp_rate" not in inputs  # nothing trained sharded
    # Sharded 0/1 Adam's local step, 40 ms above the flat one: FSDP2's 3 x 500,000 elements a rank sends.
    sharded = {"optimizer": "zero_one_adam", "topology": "sharded", "step_s_by_kind": {"l": compute + 0.04}}
    assert netsim.plan_inputs({**result, "runs": [*result["runs"], sharded]}, numel, 2)["fsdp_rate"] == pytest.approx(1_500_000 / 0.04)


def test_step_time_time_to_target_and_speedups():
    def run(name, walls, vals):
        records = [{"step": s, "wall_time": w, "loss": 9.0, "tokens_per_s": 100.0 * s, "bits_per_param": 1.0, "rounds": s,
                    "bytes_sent": 10 * s} for s, w in enumerate(walls, 1)]  # fmt: skip
        for record, val in zip(records, vals):
            if val is not None:
                record["val_loss"] = val
        return RunLog(Path(name), {"optimizer": {"name": name}}, records)

    # step 1 carries start-up; then 1 s, 1 s, 3 s (a validation) per step: the median is 1 s
    adam = run("adam", [5.0, 6.0, 7.0, 10.0], [None, 4.0, None, 3.0])
    fast = run("zero_one_adam", [2.0, 2.5, 3.0, 3.5], [None, 3.5, None, 2.9])
    slow = run("onebit_adam", [1.0, 2.0, 3.0, 4.0], [None, 3.8, None, 3.2])
    assert netsim.median_step_time(adam.records) == 1.0
    assert netsim.median_step_time(adam.records[:1]) == 5.0
    target = adam.final("val_loss")
    rows = [netsim.summarize(r, target) for r in (adam, fast, slow)]
    netsim.add_speedups(rows)
    a, f, s = rows
    assert FIELDS - {"wire_bytes_per_rank", "wire_bytes_per_node", "label", "topology"} == set(a)
    assert (a["time_to_target_s"], a["step_to_target"], a["speedup_wall"], a["speedup_time_to_target"]) == (10.0, 4, 1.0, 1.0)
    assert (f["time_to_target_s"], f["step_to_target"]) == (3.5, 4) and f["speedup_wall"] == 10.0 / 3.5 == f["speedup_time_to_target"]
    assert s["time_to_target_s"] is None and s["speedup_time_to_target"] is None and s["speedup_wall"] == 2.5
    assert f["tokens_per_s"] == 250.0 and f["rounds"] == 4 and f["bytes_sent_per_rank"] == 40
    assert netsim.speedup(None, 1.0) is None and netsim.speedup(1.0, 0.0) is None and netsim.speedup(3.0, 1.5) == 2.0
    without_adam = [netsim.summarize(fast, None)]
    netsim.add_speedups(without_adam)
    assert without_adam[0]["time_to_target_s"] is None and without_adam[0]["speedup_wall"] is None


def test_a_given_target_loss_times_every_run_without_adam():
    """--target-loss (Adam's final val_loss from an earlier run) is the target when Adam is not trained."""
    records = [{"step": s, "wall_time": 2.0 * s, "loss": 9.0, "tokens_per_s": 100.0, "bits_per_param": 0.01, "rounds": 1, "bytes_sent": 1,
                "val_loss": v} for s, v in ((1, 5.0), (2, 4.4), (3, 4.3))]  # fmt: skip
    logs = {"diloco": RunLog(Path("diloco"), {"optimizer": {"name": "diloco"}}, records)}
    assert netsim.reference_loss(logs, 0.01, None) == (None, None)
    adam, target = netsim.reference_loss(logs, 0.01, 4.4)
    assert adam == 4.4 and target == pytest.approx(4.444)
    row = netsim.summarize(logs["diloco"], target)
    netsim.add_speedups([row])
    assert (row["time_to_target_s"], row["step_to_target"], row["speedup_time_to_target"]) == (4.0, 2, None)
    row |= {"label": "diloco", "topology": None, "wire_bytes_per_rank": 2, "wire_bytes_per_node": 2}
    result = {"ranks": 2, "nodes": 2, "ranks_per_node": 1, "bandwidth": "10mbit", "latency_s": 0, "recipe": "r.yaml", "comm": None,
              "adam_val_loss": adam, "target_given": True, "target_margin": 0.01, "target_val_loss": target, "runs": [row]}  # fmt: skip
    console = Console(record=True, width=200)
    console.print(netsim.format_netsim(result))
    text = " ".join(console.export_text().split())  # the caption wraps
    assert "target: --target-loss + 1.0%, 4.4440; no Adam run: no speed-ups" in text and "4.0 s (step 2)" in text


def test_a_failed_rank_is_summed_up_by_its_error(tmp_path):
    log = tmp_path / "rank0.log"
    log.write_text("[rank0]: Traceback (most recent call last):\n[rank0]:   ...\n[rank0]: FileExistsError: [Errno 17] File\n[rank0]: exists: '/a/b'\n")
    assert netsim._last_line(log) == "FileExistsError: [Errno 17] File exists: '/a/b'"
    log.write_text("step 1\nerror: model.n_embd 128 must be divisible by model.n_head 3.\n")
    assert netsim._last_line(log) == "model.n_embd 128 must be divisible by model.n_head 3"
    log.write_text("")
    assert netsim._last_line(log) == "no output"


def test_root_and_iproute2_are_required(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(UserError, match="needs root"):
        netsim.check_prerequisites()
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(UserError, match="iproute2"):
        netsim.check_prerequisites()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--ranks", "1"], "--ranks must be between 2"),
        (["--ranks", "0"], "--ranks must be between 2"),
        (["--nodes", "0"], "--nodes must be at least 1, not 0"),
        (["--nodes", "2", "--ranks-per-node", "0"], "--ranks-per-node must be at least 1, not 0"),
        (["--bandwidth", "fast"], "bandwidth 'fast' is not understood"),
        (["--optimizers", "adam,sgd"], "--optimizers takes"),
        (["--latency", "soon"], "latency 'soon' is not understood"),
        (["--comm-sizes", "1X"], "--comm-sizes"),
        (["--set", "train.nope=1"], "unknown key"),
        (["--margin", "1.5"], "--margin must be a fraction"),
        (["--target-loss", "-1"], "--target-loss must be a positive loss, not -1.0"),
        (["--target-loss", "nan"], "--target-loss must be a positive loss"),
        (["--target-loss", "4.4", "--optimizers", "adam,zero_one_adam"], "--target-loss stands in for adam's run"),
        (["--shard"], "--shard shards inside each node"),
    ],
)
def test_bad_input_is_one_sentence_and_exit_2(capsys, tmp_path, args, message):
    sizes = [] if "--comm-sizes" in args else ["--comm-sizes", "none"]  # no model built for the default size: faster
    refused(zoa_here(capsys, "bench", "netsim", "--out", str(tmp_path), *sizes, *args), message)
    assert not any(tmp_path.iterdir())  # refused before anything was created


# ---- the emulated network: root, iproute2, namespaces ----------------------------------------------------


def _namespace_probe(qdisc: list[str]) -> bool:
    probe = f"zoa-probe-{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode:
        return False
    try:
        steps = [["ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1"]]
        steps += [["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "p0", "root", *qdisc]] if qdisc else []
        return all(subprocess.run(s, capture_output=True).returncode == 0 for s in steps)
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)


CAN_NETSIM = os.geteuid() == 0 and bool(shutil.which("ip") and shutil.which("tc")) and _namespace_probe([])
HAS_NETEM = CAN_NETSIM and _namespace_probe(["netem", "delay", "1ms"])
needs_namespaces = pytest.mark.skipif(not CAN_NETSIM, reason="needs root, iproute2 (ip, tc) and the right to create network namespaces")
LATENCY = "1ms" if HAS_NETEM else "0"  # this kernel may lack netem: then the links are shaped in rate only
QUICK = ["--set", "train.log_every=1", "--set", "train.val_every=3", "--set", "train.val_batches=1",
         "--set", "logging.wandb=disabled", "--set", "logging.tensorboard=false",
         "--set", "optimizer.freeze_step=2", "--set", "optimizer.var_freeze_step=2",  # 1-bit rounds from step 3 on
         "--set", "optimizer.local_steps=fixed", "--set", "optimizer.local_step_interval=3"]  # fmt: skip


def leftovers(prefix: str) -> list[str]:
    """Namespaces and root-namespace links whose name carries this invocation's prefix."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout.split()
    return [name for name in listed + links if name.startswith(prefix + "-")]


def processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if text in (entry / "cmdline").read_bytes().decode(errors="replace").replace("\0", " "):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def start_netsim(*args: str) -> subprocess.Popen:
    # SIGINT at its default, so the test's signal reaches Python whatever the test runner's shell did with it
    return subprocess.Popen([sys.executable, "-m", "zoa_train.cli", "bench", "netsim", *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip


@pytest.fixture(scope="module")
def netsim_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("netsim")
    proc = start_netsim("--ranks", "2", "--bandwidth", "100mbit", "--latency", LATENCY, "--steps", "6", "--comm-sizes", "1M",
                        "--optimizers", "adam,onebit_adam,zero_one_adam",
                        "--margin", "0.5", "--out", str(out), "--json", *QUICK)  # fmt: skip
    stdout, stderr = proc.communicate(timeout=400)
    return proc, stdout, stderr, out


@pytest.mark.slow
@needs_namespaces
def test_every_optimizer_trains_over_the_emulated_links(netsim_run):
    proc, stdout, stderr, out = netsim_run
    assert proc.returncode == 0, stderr[-3000:]
    result = json.loads(stdout.strip().splitlines()[-1])
    assert result == json.loads((out / "netsim.json").read_text())
    assert result["ranks"] == 2 and result["bandwidth_bits_per_s"] == 100_000_000 and result["prefix"] == f"zn{proc.pid}"
    rows = {r["optimizer"]: r for r in result["runs"]}
    assert list(rows) == ["adam", "onebit_adam", "zero_one_adam"]
    for name, row in rows.items():
        assert set(row) == FIELDS, name
        assert row["steps"] == 6 and row["median_step_s"] > 0 and row["tokens_per_s"] > 0
        assert row["wire_bytes_per_rank"] >= row["bytes_sent_per_rank"] > 0  # the wire adds headers and start-up
        run = read_run(row["run_dir"])  # kept for `zoa-train report`
        assert Path(row["run_dir"]) == out / name and run.optimizer == name and run.final("val_loss") == row["final_val_loss"]
    adam = rows["adam"]
    assert result["adam_val_loss"] == adam["final_val_loss"] and result["target_margin"] == 0.5
    assert result["target_val_loss"] == pytest.approx(1.5 * adam["final_val_loss"])
    assert adam["time_to_target_s"] is not None and adam["speedup_wall"] == adam["speedup_time_to_target"] == 1.0
    assert rows["zero_one_adam"]["bits_per_param"] < rows["onebit_adam"]["bits_per_param"] < adam["bits_per_param"]
    assert rows["zero_one_adam"]["rounds"] < rows["onebit_adam"]["rounds"] == adam["rounds"] == 6


@pytest.mark.slow
@needs_namespaces
def test_onebit_allreduce_beats_fp32_on_the_same_100mbit_links(netsim_run):
    proc, stdout, stderr, _ = netsim_run
    assert proc.returncode == 0, stderr[-3000:]
    comm = json.loads(stdout.strip().splitlines()[-1])["comm"]
    (row,) = comm["results"]
    assert comm["nproc"] == 2 and row["numel"] == 1 << 20
    assert row["fp32_bytes_per_rank"] == 4 << 20 and row["onebit_bytes_per_rank"] < (4 << 20) / 30
    # 4 MB at 100 Mbit/s, less the filter's 128 kB burst, is at least 0.3 s whatever the CPU does
    assert row["allreduce_fp32_s"] > 0.3
    assert row["speedup"] > 5


@pytest.mark.slow
@needs_namespaces
def test_nothing_is_left_after_a_run(netsim_run):
    proc, _, stderr, _ = netsim_run
    assert proc.returncode == 0, stderr[-3000:]
    assert leftovers(f"zn{proc.pid}") == []


@pytest.mark.slow
@needs_namespaces
def test_two_nodes_of_two_ranks_train_flat_and_node_aware(tmp_path):
    # 0/1 Adam on 2 namespaces of 2 ranks each: trained with the flat and with the node-aware sync, the
    # second puts fewer bytes on each node's link; bench comm times both over the same links.
    proc = start_netsim("--nodes", "2", "--ranks-per-node", "2", "--bandwidth", "100mbit", "--latency", LATENCY, "--steps", "6",
                        "--comm-sizes", "1M", "--optimizers", "zero_one_adam", "--out", str(tmp_path), "--json", *QUICK,
                        "--set", "train.micro_batch_size=8")  # fmt: skip
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    result = json.loads(stdout.strip().splitlines()[-1])
    assert (result["nodes"], result["ranks_per_node"], result["ranks"]) == (2, 2, 4)
    flat, node_aware = result["runs"]
    assert (flat["label"], flat["topology"], node_aware["label"], node_aware["topology"]) == (
        "zero_one_adam-flat",
        "flat",
        "zero_one_adam-hierarchical",
        "hierarchical",
    )
    assert "hierarchical 1-bit sync, 2 nodes x 2 ranks" in (tmp_path / "logs" / "zero_one_adam-hierarchical-rank0.log").read_text()
    # the same fp32 start-up and variance steps, then 1-bit rounds: half of flat's on each node's link
    assert node_aware["wire_bytes_per_node"] < flat["wire_bytes_per_node"]
    assert node_aware["bits_per_param"] < flat["bits_per_param"] and node_aware["rounds"] == flat["rounds"]
    (row,) = result["comm"]["results"]
    assert row["ranks_per_node"] == 2 and row["node_aware_inter_bytes_per_rank"] * 2 == pytest.approx(row["onebit_inter_bytes_per_rank"], rel=0.02)
    assert row["node_aware_s"] > 0 and leftovers(f"zn{proc.pid}") == []


@pytest.mark.slow
@needs_namespaces
def test_a_failing_rank_stops_the_others_and_the_network_goes(tmp_path):
    topo = netsim.topology(2)
    logs = [tmp_path / "rank0.log", tmp_path / "rank1.log"]
    commands = [["ip", "netns", "exec", topo.rank_ns(0), "sleep", "600"],
                ["ip", "netns", "exec", topo.rank_ns(1), "sh", "-c", "echo boom; exit 3"]]  # fmt: skip
    started = time.monotonic()
    with pytest.raises(netsim.RankFailed, match=r"test: rank 1 exited with code 3: boom"):
        with netsim.emulated_network(topo, 100_000_000, 0.0):
            assert len(leftovers(topo.prefix)) == 3  # two rank namespaces and the bridge's
            netsim.run_ranks("test", commands, logs)
    assert time.monotonic() - started < 15  # rank 0 did not sleep on
    assert leftovers(topo.prefix) == [] and processes_mentioning("sleep 600") == []


@pytest.mark.slow
@needs_namespaces
def test_a_run_failing_inside_the_ranks_exits_1_and_cleans_up(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    proc = start_netsim("--optimizers", "adam", "--latency", LATENCY, "--steps", "2", "--comm-sizes", "none", "--out", str(tmp_path / "out"),
                        *QUICK, "--set", f"data.cache_dir={not_a_dir}")  # fmt: skip
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1, stderr[-3000:]
    assert "adam: rank" in stderr and "exited with code 2: cannot create data.cache_dir" in stderr and "adam-rank" in stderr and "Traceback" not in stderr, (
        stderr
    )
    assert leftovers(f"zn{proc.pid}") == [] and processes_mentioning(str(tmp_path / "out")) == []


@needs_namespaces
@pytest.mark.skipif(HAS_NETEM, reason="this kernel has netem")
def test_latency_without_netem_is_refused_and_cleaned_up(tmp_path):
    proc = start_netsim("--optimizers", "none", "--latency", "1ms", "--comm-sizes", "1k", "--out", str(tmp_path))
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "netem" in stderr and "--latency 0" in stderr, stderr[-3000:]
    assert leftovers(f"zn{proc.pid}") == []


@pytest.mark.slow
@needs_namespaces
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupted_run_kills_its_ranks_and_cleans_up(tmp_path, sig):
    out = tmp_path / "out"
    proc = start_netsim("--optimizers", "adam", "--latency", LATENCY, "--steps", "1000", "--comm-sizes", "none", "--out", str(out), *QUICK)
    deadline = time.monotonic() + 120
    while not processes_mentioning(str(out / "adam")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert processes_mentioning(str(out / "adam")), "the ranks never started"
    time.sleep(2)  # let the ranks get going
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == {signal.SIGINT: 130, signal.SIGTERM: 143}[sig], stderr[-3000:]
    assert leftovers(f"zn{proc.pid}") == [] and processes_mentioning(str(out)) == []
