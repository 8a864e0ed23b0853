"""Kill a rank of a local run at chosen steps: what train.elastic live does (the others go on, the rank joins
again) against what --max-restarts does (every rank restarts from the last checkpoint); docs/faults.md, "Live".

    .venv/bin/python scripts/rank_churn.py --out runs/live-churn --at 300,700 --mode live --reference -- \\
        recipes/gpt2_tiny.yaml --set train.global_batch_size=48 --set train.micro_batch_size=8 --set train.checkpoint_every=50

`zoa-train run --nproc N --max-restarts K` trains into OUT/MODE; once rank 0 has logged each step of --at, the
newest rank process (the last rank, or the one started again in its place) is killed with SIGKILL. --mode live sets
train.elastic live (the launcher starts the rank again at once; it joins at a later sync), --mode restart leaves
train.elastic off (torch elastic restarts every rank from the newest checkpoint). --reference also trains the same
recipe uninterrupted into OUT/reference. Printed: each membership record, the wall time, the median step and the
final validation losses.

--nnodes M emulates M machines of --nproc ranks each, for the node-aware sync (needs root): under live, M launchers
(`--nnodes M --node-rank R --store`), each in a UTS namespace of its own (`unshare --uts`) with the hostname
churn-node<R>, so that the ranks find M nodes as on M machines; the victim is the newest rank of the last machine.
Restart and reference runs start every rank from one launcher, with comm.ranks_per_node N for the same nodes.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from node_churn import free_port, last_step, wait_for

ROOT = Path(__file__).resolve().parents[1]


def rank_pids(launcher: int) -> list[int]:
    """The rank processes the launcher started (its multiprocessing spawn children), oldest first."""
    found = subprocess.run(["pgrep", "-P", str(launcher), "-f", "spawn_main"], capture_output=True, text=True).stdout.split()
    return sorted(int(p) for p in found)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--at", default="300,700", help="steps after which a rank is killed, comma-separated")
    parser.add_argument("--mode", choices=("live", "restart"), default="live")
    parser.add_argument("--nproc", type=int, default=3, help="ranks per machine")
    parser.add_argument("--nnodes", type=int, default=1, help="emulated machines (each its own hostname; needs root)")
    parser.add_argument("--max-restarts", type=int, default=10)
    parser.add_argument("--reference", action="store_true", help="also train uninterrupted")
    parser.add_argument("run_args", nargs=argparse.REMAINDER, help="-- RECIPE [zoa-train run options]")
    args = parser.parse_args()
    common = [*(a for a in args.run_args if a != "--"), "--set", "train.log_every=1", "--overwrite"]
    one_launcher = ["--nproc", str(args.nproc * args.nnodes)]
    if args.nnodes > 1:
        one_launcher += ["--set", f"comm.ranks_per_node={args.nproc}"]
    zoa = [sys.executable, "-m", "zoa_train.cli", "run"]
    args.out.mkdir(parents=True, exist_ok=True)
    if args.reference:
        started = time.perf_counter()
        if subprocess.run([*zoa, *common, *one_launcher, "--out", str(args.out / "reference")], cwd=ROOT).returncode:
            raise SystemExit("the reference run failed")
        print(f"reference: {time.perf_counter() - started:.1f} s", flush=True)

    run_dir = args.out / args.mode
    elastic = "live" if args.mode == "live" else "off"
    command = [*zoa, *common, "--out", str(run_dir), "--max-restarts", str(args.max_restarts), "--set", f"train.elastic={elastic}"]
    if args.mode == "live" and args.nnodes > 1:
        store = f"127.0.0.1:{free_port()}"
        machine = [[*command, "--nproc", str(args.nproc), "--nnodes", str(args.nnodes), "--node-rank", str(r), "--store", store] for r in range(args.nnodes)]
        # exec keeps the launcher's pid, whose rank processes are killed
        machine = [["unshare", "--uts", "--", "sh", "-c", f'hostname churn-node{r} && exec "$@"', "sh", *m] for r, m in enumerate(machine)]
    else:
        machine = [[*command, *one_launcher]]
    started = time.perf_counter()
    logs = [open(args.out / f"{args.mode}{'' if len(machine) == 1 else r}.log", "w") for r in range(len(machine))]
    runs = [subprocess.Popen(m, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT) for m, log in zip(machine, logs)]
    for step in (int(s) for s in args.at.split(",")):
        wait_for(run_dir / "metrics.jsonl", step, runs[0])
        victim = rank_pids(runs[-1].pid)[-1]
        os.kill(victim, signal.SIGKILL)
        print(f"{time.perf_counter() - started:7.1f} s: killed rank process {victim} after step {last_step(run_dir / 'metrics.jsonl')}", flush=True)
    codes = [run.wait() for run in runs]
    for log in logs:
        log.close()
    print(f"{args.mode}: exit {codes}, {time.perf_counter() - started:.1f} s", flush=True)
    done = records(run_dir)
    for record in done:
        if "world_size" in record:
            print(json.dumps(record))
    times = [r["train_s"] for r in done if "train_s" in r]
    print(f"median step {1000 * statistics.median(times):.1f} ms")
    print(f"final val_loss {[r['val_loss'] for r in done if 'val_loss' in r][-1]:.6f}")
    if args.reference:
        print(f"reference val_loss {[r['val_loss'] for r in records(args.out / 'reference') if 'val_loss' in r][-1]:.6f}")
    raise SystemExit(max(codes))


if __name__ == "__main__":
    main()
