"""The authors' implementation on zoa-train's own work: DeepSpeed 0.19.6's AdamW, ZeroOneAdam and
OnebitAdam trained on exactly what gpt2_tiny (recipes/gpt2_tiny.yaml) feeds each rank (issue 22).

Not part of the test suite. Run from the repository root, one step at a time or all at once:

  .venv/bin/python scripts/deepspeed_peer.py setup [--venv .deepspeed-venv]   # side venv: deepspeed 0.19.6, torch 2.13.0 CPU
  .venv/bin/python scripts/deepspeed_peer.py dump --out WORK/data             # zoa-train's batches, weights, lrs
  .venv/bin/python scripts/deepspeed_peer.py train --data WORK/data --optimizer zero_one_adam --out WORK/ds_zero_one_adam
  .venv/bin/python scripts/deepspeed_peer.py table --work WORK                 # DeepSpeed beside zoa-train's runs
  .venv/bin/python scripts/deepspeed_peer.py all --work WORK                   # all of the above, zoa-train's runs too

`train` starts `torchrun --nproc-per-node 2` in the side venv on this file's `worker` command (2 Gloo
ranks). On the CPU only DeepSpeed's `compressed` comm backend runs; two run-time adaptations make it
run there, neither a change to DeepSpeed's files: a packbits op in plain torch (DeepSpeed ships one
for XPU only) and 0-dim scale tensors reshaped to [1] for Gloo's all_gather (NCCL accepts them).
The mapping of every setting is in ds_config() and in docs/results.md (issue 22).
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "gpt2_tiny.yaml"
OPTIMIZERS = {"adam": "AdamW", "zero_one_adam": "ZeroOneAdam", "onebit_adam": "OneBitAdam"}
VAL_STEPS = (100, 300, 600, 1200)
# What the side venv gets: DeepSpeed's last release with the 1-bit optimizers, a CPU torch (2.14.1 here
# would be a CUDA build of several GB), and the versions .venv has of what rebuilds the model.
SIDE_PACKAGES = ["torch==2.13.0", "transformers==5.24.0", "tokenizers==0.23.3", "safetensors==0.8.0", "huggingface_hub==2.4.0", "numpy==2.4.6"]


def setup(venv: Path) -> None:
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "pip"), "install"]
    subprocess.run(pip + SIDE_PACKAGES, check=True)
    # No CUDA here: build none of DeepSpeed's ops at install time (they would be JIT-built on use).
    subprocess.run(pip + ["deepspeed==0.19.6"], check=True, env={**os.environ, "DS_BUILD_OPS": "0"})


def dump(out: Path) -> None:
    """What zoa-train's trainer feeds each rank of gpt2_tiny: batches per rank and step, the initial
    weights (torch.manual_seed(seed) right before build_model, as Trainer._build), the lr of every step
    and the validation batches. Runs in zoa-train's venv."""
    import torch

    from zoa_train.config import load_recipe
    from zoa_train.tasks import build_task

    recipe = load_recipe(RECIPE)
    t = recipe.train
    out.mkdir(parents=True, exist_ok=True)
    schedule = recipe.lr_schedule()
    meta = {"steps": t.steps, "world": t.nproc, "grad_clip": t.grad_clip, "val_every": t.val_every, "lrs": [schedule(s) for s in range(t.steps)]}
    meta["optimizer"] = recipe.to_dict()["optimizer"]
    for rank in range(t.nproc):
        task = build_task(recipe, rank, t.nproc)
        if rank == 0:
            torch.manual_seed(t.seed)
            model = task.build_model()
            torch.save(model.state_dict(), out / "model.pt")
            model.config.to_json_file(str(out / "config.json"))
            meta["num_params"] = sum(p.numel() for p in model.parameters())
        train = torch.stack([next(task.loader)["input_ids"] for _ in range(t.steps)]).to(torch.int16)  # vocab 4,096
        val = torch.stack([b["input_ids"] for b in task.validation_batches(t.val_batches)]).to(torch.int16)
        torch.save({"train": train, "val": val}, out / f"rank{rank}.pt")
        task.close()
    (out / "meta.json").write_text(json.dumps(meta, indent=1))


def ds_config(name: str, meta: dict, comm_dtype: str = "bf16") -> dict:
    """DeepSpeed's config for zoa-train's optimizer `name` with the recipe's settings."""
    o = meta["optimizer"]
    params = {"lr": o["lr"], "betas": o["betas"], "eps": o["eps"], "weight_decay": o["weight_decay"]}
    if name == "adam":
        params |= {"torch_adam": True, "adam_w_mode": True}  # torch's AdamW, decoupled decay, bias-corrected
    else:
        # DeepSpeed's step 1 only initialises, so its step s is zoa-train's step s - 1: OnebitAdam freezes
        # after its step freeze_step (zoa-train's freeze_step + 1); ZeroOneAdam after step var_freeze_step + 1.
        params |= {"comm_backend_name": "compressed", "cuda_aware": False}
        if name == "onebit_adam":
            params["freeze_step"] = o["freeze_step"] + 1
        else:
            # Local-step intervals double every local_step_scaler steps after the freeze (no lr rule):
            # the recipe's lr halves every decay_every = 240 steps, so the same period, up to H = 8.
            params |= {"var_freeze_step": o["var_freeze_step"], "var_update_scaler": o["var_update_scaler"]}
            params |= {"local_step_scaler": 240, "local_step_clipper": o["local_step_clip"]}
    return {
        "train_micro_batch_size_per_gpu": 16,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": OPTIMIZERS[name], "params": params},
        # Adam: DDP averages, then zoa-train clips the average (the engine's clip of identical gradients
        # is the same). 1-bit: each rank clips its own gradient before anything is sent (worker()).
        "gradient_clipping": meta["grad_clip"] if name == "adam" else 0.0,
        "communication_data_type": comm_dtype,  # the recipe's allreduce_dtype for full-precision rounds
        "steps_per_print": 10**9,
    }


class CpuPackbits:
    """DeepSpeed's packbits op in plain torch: bit = not signbit, MSB first; unpack gives +1/-1."""

    def load(self):
        return self

    def packbits(self, x, numel, rank):
        import torch

        bits = (~torch.signbit(x.reshape(-1, 8))).to(torch.uint8)
        return (bits << torch.arange(7, -1, -1, dtype=torch.uint8)).sum(1, dtype=torch.uint8)

    def unpackbits(self, packed, numel, rank):
        import torch

        bits = (packed.reshape(-1, 1) >> torch.arange(7, -1, -1, dtype=torch.uint8)) & 1
        return bits.reshape(-1).float().mul_(2).sub_(1)


def adapt_deepspeed_for_cpu(counter: dict) -> None:
    """The two run-time adaptations (module docstring), plus counting what the 1-bit rounds send."""
    import deepspeed.comm
    import deepspeed.ops.op_builder

    deepspeed.ops.op_builder.PackbitsBuilder = CpuPackbits
    from deepspeed.runtime.comm import compressed

    compressed.PackbitsBuilder = CpuPackbits
    all_gather = deepspeed.comm.all_gather

    def gloo_all_gather(tensor_list, tensor, *args, **kwargs):
        if tensor.dim() == 0:  # Gloo wants the outputs' [1] shape
            tensor = tensor.reshape(1)
        return all_gather(tensor_list, tensor, *args, **kwargs)

    deepspeed.comm.all_gather = gloo_all_gather
    compressed_allreduce = compressed.CompressedBackend.compressed_allreduce

    def counted(self, buffer_m, worker_error, *args):
        counter["bits"] += worker_error.numel()  # zoa-train's ledger: 1 bit per (padded) element per 1-bit round
        counter["called"] = True
        return compressed_allreduce(self, buffer_m, worker_error, *args)

    compressed.CompressedBackend.compressed_allreduce = counted


def worker(data: Path, name: str, out: Path, steps: int | None = None, comm_dtype: str = "bf16") -> None:
    """One rank under torchrun, in the side venv."""
    import deepspeed
    import torch
    import torch.distributed as dist
    import transformers

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    meta = json.loads((data / "meta.json").read_text())
    meta["steps"] = steps or meta["steps"]  # fewer: a smoke test
    mine = torch.load(data / f"rank{rank}.pt")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config.from_json_file(str(data / "config.json")))
    model.load_state_dict(torch.load(data / "model.pt"))
    model.loss_type = model.config.loss_type = "ForCausalLM"
    counter = {"bits": 0, "called": False}
    adapt_deepspeed_for_cpu(counter)

    # zoa-train's groups (training.parameter_groups): weight decay on matrices only. The position
    # embedding's rows past seq_len never get a gradient: DeepSpeed needs exp_avg_mask for them.
    wpe = model.transformer.wpe.weight
    seq_len = mine["train"].shape[-1]
    decay = [p for p in model.parameters() if p.ndim >= 2 and p is not wpe]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    wd = meta["optimizer"]["weight_decay"]
    groups = [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}, {"params": [wpe], "weight_decay": wd}]
    if name != "adam":
        mask = torch.zeros_like(wpe)
        mask[:seq_len] = 1
        groups[2]["exp_avg_mask"] = mask
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=ds_config(name, meta, comm_dtype))
    params = list(model.parameters())
    num_params = meta["num_params"]

    def one_step(step: int | None) -> None:
        """A step on zoa-train's batch `step`, or DeepSpeed's initialisation step on zero gradients (None)."""
        if step is None:
            for p in params:
                p.grad = torch.zeros_like(p)
        else:
            for g in engine.optimizer.param_groups:
                g["lr"] = meta["lrs"][step]
            x = mine["train"][step].long()
            model(input_ids=x, labels=x).loss.backward()
            if name != "adam":  # per rank, before anything is sent (zoa-train's trainer does the same)
                torch.nn.utils.clip_grad_norm_(params, meta["grad_clip"])
        if engine.enable_backward_allreduce:  # the engine's full-precision allreduce (bf16)
            engine.allreduce_gradients()
            counter["bits"] += (16 if comm_dtype == "bf16" else 32) * num_params
            counter["called"] = True
        engine.step()
        for p in params:
            p.grad = None

    @torch.no_grad()
    def validate() -> float:
        model.eval()
        total = torch.zeros(1, dtype=torch.float64)
        for x in mine["val"]:
            total += model(input_ids=x.long(), labels=x.long()).loss.double()
        dist.all_reduce(total)  # every rank's own model, averaged, as zoa-train's validation
        model.train()
        return total.item() / (world * len(mine["val"]))

    if name != "adam":
        one_step(None)
    counter.update(bits=0, called=False)
    bits, rounds, rows = 0, 0, []
    for step in range(meta["steps"]):
        one_step(step)
        bits += counter["bits"]
        rounds += counter["called"]
        counter.update(bits=0, called=False)
        done = step + 1
        if done % meta["val_every"] == 0 or done == meta["steps"]:
            row = {"step": done, "val_loss": validate(), "bits_per_param": bits / (num_params * done), "rounds": rounds}
            rows.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    dist.destroy_process_group()


def train(venv: Path, data: Path, name: str, out: Path, steps: int | None = None, comm_dtype: str = "bf16") -> None:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    torchrun = [str(venv / "bin" / "torchrun"), "--nproc-per-node", "2", "--master-port", "29517"]
    subprocess.run(
        torchrun
        + [__file__, "worker", "--data", str(data), "--optimizer", name, "--out", str(out)]
        + (["--steps", str(steps)] if steps else [])
        + ["--comm-dtype", comm_dtype],
        check=True,
        env=env,
    )


def read_rows(path: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in rows if "val_loss" in r}


def table(work: Path) -> str:
    lines = [
        "| optimizer | implementation | " + " | ".join(f"val loss @{s}" for s in VAL_STEPS) + " | bits/param | rounds |",
        "|---|---|" + "---|" * (len(VAL_STEPS) + 2),
    ]
    for name in OPTIMIZERS:
        runs = (("zoa-train", f"zoa_{name}"), ("DeepSpeed 0.19.6", f"ds_{name}"))
        for who, run in runs:
            path = work / run / "metrics.jsonl"
            if not path.exists():
                continue
            rows = read_rows(path)
            last = rows[max(rows)]
            bits, rounds = last["bits_per_param"], last["rounds"]  # zoa-train logs them in the same record
            losses = " | ".join(f"{rows[s]['val_loss']:.4f}" if s in rows else "-" for s in VAL_STEPS)
            lines.append(f"| {name} | {who} | {losses} | {bits:.3f} | {rounds} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for command in ("setup", "dump", "train", "worker", "table", "all"):
        p = sub.add_parser(command)
        p.add_argument("--venv", type=Path, default=ROOT / ".deepspeed-venv")
        p.add_argument("--data", type=Path)
        p.add_argument("--out", type=Path)
        p.add_argument("--work", type=Path, default=Path("/work/runs/ds_peer"))
        p.add_argument("--optimizer", choices=OPTIMIZERS, default="zero_one_adam")
        # fp32: a control against zoa-train run with --set optimizer.allreduce_dtype=fp32 under the side venv's torch
        p.add_argument("--comm-dtype", choices=("bf16", "fp32"), default="bf16")
        p.add_argument("--steps", type=int, help="fewer steps than the recipe's (a smoke test)")
    a = parser.parse_args()
    if a.command == "setup":
        setup(a.venv)
    elif a.command == "dump":
        dump(a.out)
    elif a.command == "train":
        train(a.venv, a.data, a.optimizer, a.out, a.steps, a.comm_dtype)
    elif a.command == "worker":
        worker(a.data, a.optimizer, a.out, a.steps, a.comm_dtype)
    elif a.command == "table":
        print(table(a.work))
    else:
        if not (a.venv / "bin" / "torchrun").exists():
            setup(a.venv)
        dump(a.work / "data")
        for name in OPTIMIZERS:  # one training at a time
            zoa = ["zoa-train", "run", str(RECIPE), "--set", f"optimizer.name={name}", "--set", "logging.wandb=disabled"]
            subprocess.run([str(Path(sys.executable).parent / zoa[0]), *zoa[1:], "--out", str(a.work / f"zoa_{name}")], check=True)
            train(a.venv, a.work / "data", name, a.work / f"ds_{name}")
        print(table(a.work))


if __name__ == "__main__":
    main()
