"""Lose a node and bring it back, under torchrun's elastic agent on this machine: what a run with
train.elastic reshard does when its membership changes (docs/faults.md, "Elastic: a node leaves, the run goes on").

    .venv/bin/python scripts/node_churn.py --out runs/churn --events 300:400,700:800 -- recipes/gpt2_tiny.yaml \\
        --set train.global_batch_size=48 --set train.micro_batch_size=8 --set train.checkpoint_every=50

Two torchrun agents meet at a c10d rendezvous on 127.0.0.1 (`--nnodes 1:2`): the first, which holds the
rendezvous store, runs --first ranks, the second --second ranks. For each event KILL:BACK the second
node is lost once rank 0 has logged step KILL (its agent and its ranks killed with SIGKILL at once), and
a new agent for it is started once step BACK is logged (BACK may be left out: it stays away). The
survivors' agent restarts its ranks at each change, and the run continues from its newest synchronised
checkpoint at the new world size. --reference also trains the same recipe uninterrupted on all the
ranks (`zoa-train run --nproc`) into OUT/reference, for the final validation loss to compare with.

Printed: each event's metrics record (the restart, the world sizes, the steps trained again and the
seconds from the failed attempt's last record to the resume) and the final validation losses. Extra
arguments after `--` go to `zoa-train run` (the recipe first); train.elastic reshard and log_every 1 are
set here, and the run directory is OUT/run.
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def last_step(metrics: Path) -> int:
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    for line in reversed(lines):
        try:
            return json.loads(line)["step"]
        except (json.JSONDecodeError, KeyError):
            continue
    return 0


def wait_for(metrics: Path, step: int, first: subprocess.Popen) -> None:
    while last_step(metrics) < step:
        if first.poll() is not None:
            raise SystemExit(f"the run ended (exit {first.returncode}) before step {step}")
        time.sleep(0.05)


# Each attempt's ranks meet in a store of their own (what train.elastic reshard requires of torchrun).
AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def agent_command(nproc: int, hosts_store: bool, port: int, max_restarts: int, run_args: list[str]) -> list[str]:
    """One node's torchrun: an elastic agent of 1 to 2 nodes meeting at a c10d rendezvous on this machine,
    running `zoa-train run RUN_ARGS`. The first agent holds the store (its death would end the rendezvous);
    a round closes 3 s after it has its minimum, and an agent silent for 3 s is dropped."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1:2",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=node-churn",
        f"--rdzv-conf=is_host={str(hosts_store).lower()},last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.5",
        "-m",
        "zoa_train.cli",
        "run",
        *run_args,
    ]


def kill_node(agent: subprocess.Popen) -> list[int]:
    """SIGKILL to the agent and its ranks at once (torch elastic starts each rank in a session of its own);
    returns the processes killed, the agent first."""
    ranks = subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True, text=True).stdout.split()
    killed = [agent.pid, *map(int, ranks)]
    for pid in killed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    agent.wait()
    return killed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--events", default="300:400", help="KILL:BACK steps, comma-separated (BACK optional)")
    parser.add_argument("--first", type=int, default=2, help="ranks of the node that stays")
    parser.add_argument("--second", type=int, default=1, help="ranks of the node that is lost")
    parser.add_argument("--max-restarts", type=int, default=10)
    parser.add_argument("--reference", action="store_true", help="also train uninterrupted on all the ranks")
    parser.add_argument("run_args", nargs=argparse.REMAINDER, help="-- RECIPE [zoa-train run options]")
    args = parser.parse_args()
    run_args = [a for a in args.run_args if a != "--"]
    events = [tuple(int(x) if x else None for x in (e.split(":") + [""])[:2]) for e in args.events.split(",")]
    common = [*run_args, "--set", "train.elastic=reshard", "--set", "train.log_every=1"]
    args.out.mkdir(parents=True, exist_ok=True)
    if args.reference:
        started = time.perf_counter()
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "zoa_train.cli",
                "run",
                *common,
                "--out",
                str(args.out / "reference"),
                "--overwrite",
                "--nproc",
                str(args.first + args.second),
            ],
            cwd=ROOT,
        )
        if done.returncode:
            raise SystemExit(f"the reference run failed (exit {done.returncode})")
        print(f"reference: {time.perf_counter() - started:.1f} s", flush=True)

    run_dir, port = args.out / "run", free_port()
    if run_dir.exists():
        raise SystemExit(f"{run_dir} exists: give another --out")

    def agent(nproc: int, host: bool, log: str) -> subprocess.Popen:
        # --resume auto: torchrun starts the ranks again with this command line whenever a node joins
        command = agent_command(nproc, host, port, args.max_restarts, [*common, "--out", str(run_dir), "--resume", "auto"])
        with open(args.out / log, "a") as sink:
            return subprocess.Popen(command, cwd=ROOT, env={**os.environ, **AGENT_ENV}, stdout=sink, stderr=subprocess.STDOUT)

    started = time.perf_counter()
    first = agent(args.first, True, "first.log")
    second = agent(args.second, False, "second.log")
    for kill, back in events:
        wait_for(run_dir / "metrics.jsonl", kill, first)
        kill_node(second)
        print(f"{time.perf_counter() - started:7.1f} s: lost the second node after step {last_step(run_dir / 'metrics.jsonl')}", flush=True)
        if back is None:
            second = None
            break
        wait_for(run_dir / "metrics.jsonl", back, first)
        second = agent(args.second, False, "second.log")
        print(f"{time.perf_counter() - started:7.1f} s: the second node is back after step {last_step(run_dir / 'metrics.jsonl')}", flush=True)
    code = first.wait()
    if second is not None:
        second.wait()
    print(f"run: exit {code}, {time.perf_counter() - started:.1f} s", flush=True)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        if "world_size" in record:
            print(json.dumps(record))
    final = [r["val_loss"] for r in records if "val_loss" in r]
    if final:
        print(f"final val_loss {final[-1]:.6f}")
    if args.reference:
        reference = [json.loads(line) for line in (args.out / "reference" / "metrics.jsonl").read_text().splitlines()]
        print(f"reference val_loss {[r['val_loss'] for r in reference if 'val_loss' in r][-1]:.6f}")
    raise SystemExit(code)


if __name__ == "__main__":
    main()
