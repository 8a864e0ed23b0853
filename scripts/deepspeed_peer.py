"""The authors' implementation on zoa-train's own work: DeepSpeed 0.19.6's AdamW, ZeroOneAdam and
OnebitAdam trained on exactly what gpt2_tiny (recipes/gpt2_tiny.yaml) feeds each rank (issue 22).

Not part of the test suite. Run from the repository root, one step at a time or all at once:

  .venv/bin/python scripts/deepspeed_peer.py setup [--venv .deepspeed-venv]   # side venv: deepspeed 0.19.6, torch 2.13.0 CPU
  .venv/bin/python scripts/deepspeed_peer.py dump --out WORK/data             # zoa-train's batches, weights, lrs
  .venv/bin/python scripts/deepspeed_peer.py train --data WORK/data --optimizer zero_one_adam --out WORK/ds_zero_one_adam
  .venv/bin/python scripts/deepspeed_peer.py table --work WORK                 # DeepSpeed beside zoa-train's runs
  .venv/bin/python scripts/deepspeed_peer.py all --work WORK                   # all of the above, zoa-train's runs too
  .venv/bin/python scripts/deepspeed_peer.py sweep --work WORK                 # DeepSpeed's lr sweep and the diagnostics

`train` starts `torchrun --nproc-per-node 2` in the side venv on this file's `worker` command (2 Gloo
ranks). On the CPU only DeepSpeed's `compressed` comm backend runs; two run-time adaptations make it
run there, neither a change to DeepSpeed's files: a packbits op in plain torch (DeepSpeed ships one
for XPU only) and 0-dim scale tensors reshaped to [1] for Gloo's all_gather (NCCL accepts them).
The mapping of every setting is in ds_config() and in docs/results/authors-implementation.md (issue 22).
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "gpt2_tiny.yaml"
OPTIMIZERS = {"adam": "AdamW", "zero_one_adam": "ZeroOneAdam", "onebit_adam": "OnebitAdam"}  # DeepSpeed's class names
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


def dump(out: Path, seed: int | None = None) -> None:
    """What zoa-train's trainer feeds each rank of gpt2_tiny: batches per rank and step, the initial
    weights (torch.manual_seed(seed) right before build_model, as Trainer._build), the lr of every step
    and the validation batches; `seed` in place of the recipe's train.seed. Runs in zoa-train's venv."""
    import torch

    from zoa_train.config import load_recipe
    from zoa_train.tasks import build_task

    recipe = load_recipe(RECIPE, [f"train.seed={seed}"] if seed is not None else [])
    t = recipe.train
    out.mkdir(parents=True, exist_ok=True)
    schedule = recipe.lr_schedule()
    meta = {"steps": t.steps, "world": t.nproc, "grad_clip": t.grad_clip, "val_every": t.val_every, "lrs": [schedule(s) for s in range(t.steps)]}
    meta["optimizer"] = recipe.to_dict()["optimizer"]
    meta["bias_factors"] = bias_factors(meta["optimizer"], meta["lrs"])
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


def bias_factors(o: dict, lrs: list[float]) -> dict[str, list[float]]:
    """Per step, what turns an uncorrected step (DeepSpeed's 1-bit optimizers) into zoa-train's
    bias-corrected one: sqrt(1 - b2^k) / (1 - b1^(t+1)), k the variance updates so far (every warm-up
    step for 1-bit Adam, until freeze_step; ZeroOneSchedule's sparse ones for 0/1 Adam, until
    var_freeze_step). The `--bias-corrected-lr` diagnostic multiplies DeepSpeed's lr by it."""
    from zoa_train.optim.schedules import ZeroOneSchedule

    b1, b2 = o["betas"]
    knobs = ("var_freeze_step", "var_update_scaler", "local_steps", "local_step_clip", "local_step_scaler", "local_step_interval")
    schedule = ZeroOneSchedule(**{k: o[k] for k in knobs})
    zero_one = []
    for t, lr in enumerate(lrs):
        schedule.advance(lr)
        zero_one.append((1 - b2**schedule.variance_updates) ** 0.5 / (1 - b1 ** (t + 1)))
    onebit = [(1 - b2 ** min(t + 1, o["freeze_step"])) ** 0.5 / (1 - b1 ** (t + 1)) for t in range(len(lrs))]
    return {"zero_one_adam": zero_one, "onebit_adam": onebit}


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
        if counter.get("averaged"):  # the full-precision diagnostic: the gradient is already the average
            return buffer_m
        counter["bits"] += worker_error.numel()  # zoa-train's ledger: 1 bit per (padded) element per 1-bit round
        counter["called"] = True
        return compressed_allreduce(self, buffer_m, worker_error, *args)

    compressed.CompressedBackend.compressed_allreduce = counted


def worker(data: Path, name: str, out: Path, steps: int | None = None, comm_dtype: str = "bf16", variant: dict | None = None) -> None:
    """One rank under torchrun, in the side venv. `variant`: lr_scale (every lr times it), bias_corrected_lr
    (each step's lr times bias_factors', so that DeepSpeed's uncorrected steps equal zoa-train's
    bias-corrected ones) and full_precision_before_freeze (ZeroOneAdam's steps between variance updates
    before var_freeze_step averaged in full precision instead of 1-bit compressed), for the diagnostics."""
    import deepspeed
    import torch
    import torch.distributed as dist
    import transformers

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    meta = json.loads((data / "meta.json").read_text())
    meta["steps"] = steps or meta["steps"]  # fewer: a smoke test
    variant = variant or {}
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
            lr = meta["lrs"][step] * variant.get("lr_scale", 1.0)
            if variant.get("bias_corrected_lr"):
                lr *= meta["bias_factors"][name][step]
            for g in engine.optimizer.param_groups:
                g["lr"] = lr
            x = mine["train"][step].long()
            model(input_ids=x, labels=x).loss.backward()
            if name != "adam":  # per rank, before anything is sent (zoa-train's trainer does the same)
                torch.nn.utils.clip_grad_norm_(params, meta["grad_clip"])
        # The diagnostic: ZeroOneAdam's steps between variance updates before the freeze, which DeepSpeed
        # 1-bit compresses (the raw gradient), get the engine's full-precision average instead.
        averaged = step is not None and variant.get("full_precision_before_freeze") and not engine.optimizer.freeze_key
        if engine.enable_backward_allreduce or averaged:  # the engine's full-precision allreduce (bf16)
            counter["averaged"] = averaged and not engine.enable_backward_allreduce
            engine.allreduce_gradients()
            counter["bits"] += (16 if comm_dtype == "bf16" else 32) * num_params
            counter["called"] = True
        engine.step()
        counter["averaged"] = False
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


def train(venv: Path, data: Path, name: str, out: Path, steps: int | None = None, comm_dtype: str = "bf16", variant: dict | None = None) -> None:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    torchrun = [str(venv / "bin" / "torchrun"), "--nproc-per-node", "2", "--master-port", "29517"]
    subprocess.run(
        torchrun
        + [__file__, "worker", "--data", str(data), "--optimizer", name, "--out", str(out)]
        + (["--steps", str(steps)] if steps else [])
        + ["--comm-dtype", comm_dtype, "--variant", json.dumps(variant or {})],
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


LR_SCALES = (1.0, 0.5, 0.25, 0.125)  # the recipe's 3e-3 down to 3.75e-4; then halved on while the smallest is the best
SMALLEST_SCALE = 1 / 64
DIAGNOSTICS = {  # run name: (optimizer, variant)
    "ds_onebit_adam_biascorrected": ("onebit_adam", {"bias_corrected_lr": True}),
    "ds_zero_one_adam_biascorrected": ("zero_one_adam", {"bias_corrected_lr": True}),
    "ds_zero_one_adam_biascorrected_fp": ("zero_one_adam", {"bias_corrected_lr": True, "full_precision_before_freeze": True}),
}


def run_name(name: str, scale: float) -> str:
    return f"ds_{name}" if scale == 1.0 else f"ds_{name}_lr{scale:g}"


def final_loss(out: Path) -> float:
    rows = read_rows(out / "metrics.jsonl")
    return rows[max(rows)]["val_loss"]


def run_once(venv: Path, work: Path, run: str, name: str, variant: dict) -> None:
    """Train `run` unless it is already in `work` (a sweep resumes), timed."""
    import time

    out = work / run
    if (out / "metrics.jsonl").exists():
        return
    start = time.perf_counter()
    train(venv, work / "data", name, out, variant=variant)
    (out / "minutes").write_text(f"{(time.perf_counter() - start) / 60:.1f}\n")


def sweep(venv: Path, work: Path) -> str:
    """DeepSpeed's 1-bit optimizers over the lr sweep (LR_SCALES, then halving on while the smallest lr
    gives the lowest final validation loss, so that the best is never at the sweep's edge), then the
    diagnostics; one run at a time, each timed; their table. Dumps zoa-train's work first where `work`
    has none, or one from before the dump held the bias-correction factors."""
    meta = work / "data" / "meta.json"
    if not meta.exists() or "bias_factors" not in json.loads(meta.read_text()):
        dump(work / "data")
    runs = {}
    for name in ("zero_one_adam", "onebit_adam"):
        scales = list(LR_SCALES)
        for scale in scales:
            run_once(venv, work, run_name(name, scale), name, {"lr_scale": scale} if scale != 1.0 else {})
            runs[run_name(name, scale)] = (name, {"lr_scale": scale} if scale != 1.0 else {})
            losses = {s: final_loss(work / run_name(name, s)) for s in scales if s >= scale}
            if scale == scales[-1] and min(losses, key=losses.get) == scale and scale / 2 >= SMALLEST_SCALE:
                scales.append(scale / 2)
    for run, (name, variant) in DIAGNOSTICS.items():
        run_once(venv, work, run, name, variant)
        runs[run] = (name, variant)
    peak = json.loads((work / "data" / "meta.json").read_text())["optimizer"]["lr"]
    lines = ["| DeepSpeed 0.19.6 | peak lr | variant | " + " | ".join(f"@{s}" for s in VAL_STEPS) + " | bits/param | rounds | minutes |"]
    lines.append("|---|---|---|" + "---|" * (len(VAL_STEPS) + 3))
    for run, (name, variant) in runs.items():
        rows = read_rows(work / run / "metrics.jsonl")
        last = rows[max(rows)]
        minutes = (work / run / "minutes").read_text().strip() if (work / run / "minutes").exists() else "-"
        what = ", ".join(k for k in variant if k != "lr_scale") or "-"
        losses = " | ".join(f"{rows[s]['val_loss']:.4f}" if s in rows else "-" for s in VAL_STEPS)
        lr = peak * variant.get("lr_scale", 1.0)
        lines.append(f"| {OPTIMIZERS[name]} | {lr:.3g} | {what} | {losses} | {last['bits_per_param']:.3f} | {last['rounds']} | {minutes} |")
    return "\n".join(lines)


def variant_of(a: argparse.Namespace) -> dict:
    variant = {"lr_scale": a.lr_scale} if a.lr_scale != 1.0 else {}
    if a.bias_corrected_lr:
        variant["bias_corrected_lr"] = True
    if a.full_precision_before_freeze:
        if a.optimizer != "zero_one_adam":
            print("error: --full-precision-before-freeze is a ZeroOneAdam diagnostic: pass --optimizer zero_one_adam.", file=sys.stderr)
            sys.exit(2)
        variant["full_precision_before_freeze"] = True
    return variant


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for command in ("setup", "dump", "train", "worker", "table", "sweep", "all"):
        p = sub.add_parser(command)
        p.add_argument("--venv", type=Path, default=ROOT / ".deepspeed-venv")
        p.add_argument("--data", type=Path)
        p.add_argument("--out", type=Path)
        p.add_argument("--work", type=Path, default=Path("/work/runs/ds_peer"))
        p.add_argument("--optimizer", choices=OPTIMIZERS, default="zero_one_adam")
        # fp32: a control against zoa-train run with --set optimizer.allreduce_dtype=fp32 under the side venv's torch
        p.add_argument("--comm-dtype", choices=("bf16", "fp32"), default="bf16")
        p.add_argument("--steps", type=int, help="fewer steps than the recipe's (a smoke test)")
        p.add_argument("--seed", type=int, help="dump and all: this seed in place of the recipe's train.seed")
        p.add_argument("--lr-scale", type=float, default=1.0, help="every step's lr times this (the lr sweep)")
        p.add_argument("--bias-corrected-lr", action="store_true", help="diagnostic: DeepSpeed's steps scaled to zoa-train's bias-corrected ones")
        p.add_argument("--full-precision-before-freeze", action="store_true", help="diagnostic (ZeroOneAdam): no 1-bit rounds before var_freeze_step")
        p.add_argument("--variant", type=json.loads, default=None, help=argparse.SUPPRESS)  # train -> worker
    a = parser.parse_args()
    if a.command == "setup":
        setup(a.venv)
    elif a.command == "dump":
        dump(a.out, a.seed)
    elif a.command == "train":
        train(a.venv, a.data, a.optimizer, a.out, a.steps, a.comm_dtype, variant_of(a))
    elif a.command == "worker":
        worker(a.data, a.optimizer, a.out, a.steps, a.comm_dtype, a.variant)
    elif a.command == "table":
        print(table(a.work))
    elif a.command == "sweep":
        print(sweep(a.venv, a.work))
    else:
        if not (a.venv / "bin" / "torchrun").exists():
            setup(a.venv)
        dump(a.work / "data", a.seed)
        for name in OPTIMIZERS:  # one training at a time
            zoa = ["zoa-train", "run", str(RECIPE), "--set", f"optimizer.name={name}", "--set", "logging.wandb=disabled"]
            zoa += ["--set", f"train.seed={a.seed}"] if a.seed is not None else []
            subprocess.run([str(Path(sys.executable).parent / zoa[0]), *zoa[1:], "--out", str(a.work / f"zoa_{name}")], check=True)
            train(a.venv, a.work / "data", name, a.work / f"ds_{name}")
        print(table(a.work))


if __name__ == "__main__":
    main()
