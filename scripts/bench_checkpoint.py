"""The step that saves a checkpoint against a normal step, with the background writer and without it.

    .venv/bin/python scripts/bench_checkpoint.py                       # gpt2_tiny, 2 CPU ranks, unsharded and sharded (1 node x 2)
    .venv/bin/python scripts/bench_checkpoint.py --recipe recipes/llama_tiny.yaml --steps 80 --every 8

Each configuration trains --steps steps on --nproc local ranks (processes of this script's own, Gloo on
CPU, or NCCL where the recipe's backend says so), checkpointing every --every steps, in two modes:

- background: as zoa-train runs (RunDirectory.save_in_background): the step that saves waits for the
  copy to host memory (and for the previous checkpoint's write, if it is still going);
- waited: the same writes, but the step waits for them to be written, agreed and published
  (save_in_background followed by wait_for_save): what a synchronous checkpoint costs.

A step's time is from the start of its forward to the start of the next step's (so it includes
logging and the save). Printed per configuration and mode: the median normal step (neither saving
nor right after a save), the median step that saves and its ratio to the normal step (the issue's
target: at most 1.2 with the background writer), and the median step right after a save (the
background writer shares the CPU with it). Steps before --warmup are left out, and so is the last
(the run's end waits for its checkpoint). Rank 0's times; the ranks wait for each other every step.

With PYTHONPATH set to another checkout (e.g. `git archive HEAD~1 zoa_train | tar -x -C /tmp/old`),
`--modes as-is` times that code's own checkpoints (before the background writer: the synchronous,
gathered save).
"""

import argparse
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp


def _rank(rank: int, world: int, port: int, mode: str, recipe: dict, out_dir: str, result: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    from zoa_train.train import trainer as trainer_module

    if mode == "waited":
        from zoa_train.train.rundir import RunDirectory

        background = RunDirectory.save_in_background

        def waited(self, *args, **kwargs):
            background(self, *args, **kwargs)
            self.wait_for_save()

        RunDirectory.save_in_background = waited
    starts: list[float] = []
    train_step = trainer_module.Trainer.train_step

    def timed(self):
        starts.append(time.perf_counter())
        return train_step(self)

    trainer_module.Trainer.train_step = timed
    summary = trainer_module.run_rank(recipe, out_dir, None, overwrite=True)
    if isinstance(summary, dict) and "user_error" in summary:
        raise SystemExit(summary["user_error"])
    torch.save(starts, result)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(recipe: dict, nproc: int, mode: str, every: int, warmup: int) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        port, result = _free_port(), str(Path(tmp) / "starts.pt")
        procs = [ctx.Process(target=_rank, args=(r, nproc, port, mode, recipe, str(Path(tmp) / "run"), result if r == 0 else os.devnull)) for r in range(nproc)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode != 0 for p in procs):
            raise SystemExit(f"a rank failed ({mode}): exit codes {[p.exitcode for p in procs]}")
        starts = torch.load(result)
    durations = {step: starts[step] - starts[step - 1] for step in range(1, len(starts))}  # step k: its forward to step k+1's
    kept = {k: d for k, d in durations.items() if k >= warmup}
    saving = [d for k, d in kept.items() if k % every == 0]
    after = [d for k, d in kept.items() if k % every == 1]
    normal = [d for k, d in kept.items() if k % every not in (0, 1)]
    step, save = statistics.median(normal), statistics.median(saving)
    return {"normal_s": step, "save_s": save, "ratio": save / step, "after_s": statistics.median(after), "saves": len(saving)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/gpt2_tiny.yaml")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--modes", default="background,waited")
    parser.add_argument("--layouts", default="unsharded,sharded")
    parser.add_argument("--cache-dir", default=None, help="data.cache_dir (default: the recipe's)")
    parser.add_argument("--set", action="append", default=[], help="more recipe overrides, KEY=VALUE")
    args = parser.parse_args()

    from zoa_train.config import load_recipe

    common = [
        f"train.nproc={args.nproc}",
        f"train.steps={args.steps}",
        f"train.checkpoint_every={args.every}",
        f"train.log_every={args.steps}",
        "train.val_every=0",
        "train.val_batches=1",
        "logging.wandb=disabled",
        "logging.tensorboard=false",
        *([f"data.cache_dir={args.cache_dir}"] if args.cache_dir else []),
        *args.set,
    ]
    layouts = {"unsharded": [], "sharded": ["comm.shard=node", f"comm.ranks_per_node={args.nproc}"]}
    print(f"{args.recipe}, {args.nproc} ranks, {args.steps} steps, a checkpoint every {args.every} (torch {torch.__version__}, {os.cpu_count()} CPUs)")
    print(f"{'layout':10} {'mode':11} {'normal step':>12} {'saving step':>12} {'ratio':>6} {'step after':>11} {'saves':>6}")
    for layout in args.layouts.split(","):
        recipe = load_recipe(args.recipe, [*common, *layouts[layout]]).to_dict()
        for mode in args.modes.split(","):
            m = measure(recipe, args.nproc, mode, args.every, args.warmup)
            print(
                f"{layout:10} {mode:11} {m['normal_s'] * 1e3:10.1f}ms {m['save_s'] * 1e3:10.1f}ms {m['ratio']:6.2f} {m['after_s'] * 1e3:9.1f}ms {m['saves']:6d}",
                flush=True,
            )


if __name__ == "__main__":
    main()
