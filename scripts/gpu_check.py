"""GPU validation, prepared for the day a GPU is lent (one GPU, no network, a few minutes):

    python scripts/gpu_check.py                 # on CUDA: every check below
    python scripts/gpu_check.py --device cpu    # the same checks on the CPU (the test suite runs this)

1. sign packing and unpacking on the device equal the CPU's, bit for bit;
2. one step of each optimizer on the device equals the same step on the CPU (one rank; the math of the
   flat state, the denominators, update clipping, weight decay);
3. short `zoa-train run`s of recipes/gpt2_tiny.yaml on one rank with each optimizer (NCCL on CUDA), in
   bf16 and fp16 on CUDA, and a run stopped at a checkpoint and resumed that ends on exactly the parameters
   of an uninterrupted one (checkpoints read to the CPU, device RNG restored through it).
One GPU cannot validate what needs two ranks on separate devices: the 1-bit allreduce's passes on CUDA
across ranks, NCCL between ranks, kernel launches per 1-bit call. Prints one line per check; exit 1 on a
failure.
"""

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from zoa_train.comm import pack_signs, unpack_signs  # noqa: E402
from zoa_train.optim import DataParallelAdam, OneBitAdam, ZeroOneAdam  # noqa: E402

FAILED = []


def report(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'}  {name}{'  ' + detail if detail else ''}", flush=True)
    if not ok:
        FAILED.append(name)


def check_packing(device: torch.device) -> None:
    x = torch.randn(3 * (1 << 20) + 5, generator=torch.Generator().manual_seed(0))
    x[::97] = 0.0
    start = time.perf_counter()
    packed = pack_signs(x.to(device))
    signs = unpack_signs(packed, x.numel(), 0.5)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    reference = pack_signs(x)
    ok = torch.equal(packed.cpu(), reference) and torch.equal(signs.cpu(), unpack_signs(reference, x.numel(), 0.5))
    report("pack/unpack equal the CPU's", ok, f"{x.numel():,} signs in {elapsed * 1e3:.1f} ms")


def check_optimizers(device: torch.device) -> None:
    for name, make in (
        ("DataParallelAdam", lambda p: DataParallelAdam(p, lr=1e-2, weight_decay=0.1, bias_correction=True)),
        ("OneBitAdam", lambda p: OneBitAdam(p, lr=1e-2, weight_decay=0.1, freeze_step=2)),
        ("ZeroOneAdam", lambda p: ZeroOneAdam(p, lr=1e-2, weight_decay=0.1, var_freeze_step=4, var_update_scaler=1)),
    ):
        results = []
        for where in (torch.device("cpu"), device):
            params = [torch.nn.Parameter(torch.linspace(-1, 1, n, device=where)) for n in (5000, 37)]
            opt = make(params)
            for t in range(6):
                for i, p in enumerate(params):
                    g = torch.Generator().manual_seed(10 * t + i)
                    p.grad = torch.randn(p.shape, generator=g).to(where) * (1 + t)
                opt.step()
            results.append([p.detach().cpu() for p in params])
        ok = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(*results))
        report(f"{name}: 6 steps on {device.type} equal the CPU's", ok)


def zoa(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zoa_train.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def check_runs(device: torch.device, quick: bool) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    precisions = ["bf16", "fp16"] if device.type == "cuda" else ["fp32"]
    optimizers = ["zero_one_adam"] if quick else ["adam", "onebit_adam", "zero_one_adam"]
    with tempfile.TemporaryDirectory() as tmp:
        common = ["train.nproc=1", f"train.backend={backend}", "train.log_every=1", "train.val_every=0", "train.val_batches=1",
                  "logging.wandb=disabled", "logging.tensorboard=false", "optimizer.freeze_step=2", "optimizer.var_freeze_step=2",
                  "optimizer.local_steps=fixed", "optimizer.local_step_interval=2", f"data.cache_dir={tmp}/cache"]
        for precision in precisions:
            for optimizer in optimizers:
                out = f"{tmp}/{precision}_{optimizer}"
                sets = [*common, "train.steps=6", f"train.precision={precision}", f"optimizer.name={optimizer}"]
                start = time.perf_counter()
                done = zoa("run", "recipes/gpt2_tiny.yaml", "--out", out, *[a for s in sets for a in ("--set", s)])
                detail = f"{time.perf_counter() - start:.1f} s" if done.returncode == 0 else done.stderr.strip().splitlines()[-1][:300]
                report(f"run {optimizer} {precision} on {backend}", done.returncode == 0, detail)
        # resume: stop at the step-3 checkpoint (inside a local-step period), continue, compare with a whole run
        sets = [*common, "train.steps=6", "train.checkpoint_every=3", "optimizer.name=zero_one_adam", "model.dropout=0.1",
                f"train.precision={precisions[0]}"]
        flags = [a for s in sets for a in ("--set", s)]
        whole = zoa("run", "recipes/gpt2_tiny.yaml", "--out", f"{tmp}/whole", *flags)
        resumed = zoa("run", "recipes/gpt2_tiny.yaml", "--out", f"{tmp}/resumed", "--resume", f"{tmp}/whole/checkpoints/step_00000003", *flags)
        ok = whole.returncode == 0 and resumed.returncode == 0
        if ok:
            a = torch.load(f"{tmp}/whole/checkpoints/step_00000006/model.pt")
            b = torch.load(f"{tmp}/resumed/checkpoints/step_00000006/model.pt")
            ok = all(torch.equal(a[k], b[k]) for k in a)
        report("resume inside a local-step period ends on the uninterrupted run's parameters", ok)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--quick", action="store_true", help="one optimizer in the run checks")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --device cpu to check the script itself")
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    check_packing(device)
    check_optimizers(device)
    check_runs(device, args.quick)
    print(f"{len(FAILED)} failed" if FAILED else "all passed")
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
