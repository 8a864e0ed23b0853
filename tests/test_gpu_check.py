"""scripts/gpu_check.py, the GPU validation kept ready for a lent GPU, runs its checks on the CPU too
(the two-rank checks on two Gloo ranks sharing the CPU)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # scripts/gpu_check.py on the CPU: rank groups and the integration examples

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_passes_on_the_cpu():
    # Every section but `runs`: on the CPU its 0/1 Adam run on Gloo and its exact resume inside a
    # local-step period are what tests/test_run.py's test_gpt2_tiny_runs_end_to_end_and_resumes_exactly
    # checks (on 2 ranks); on a GPU (NCCL, bf16 and fp16) it is the script's own, and runs there.
    # Nor `scale`: on the CPU its checks are tests/test_blocks.py's (recomputed and compiled blocks) and
    # tests/test_monitor.py's and test_report.py's (memory in every record, no MFU on a CPU).
    command = [sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--quick", "--skip", "runs,scale"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "FAIL" not in done.stdout and "all passed" in done.stdout
    # What can differ on a CPU: the native 1-bit kernels against the torch path (three shapes), ranks
    # agreeing on the 1-bit average and on 0/1 Adam's parameters (flat and node-aware), its delayed sync
    # equal to the in-step one, rounds overlapped
    # with backward equal to the same buckets in step(), sharded 0/1 Adam equal to it unsharded and its rounds
    # started as FSDP2 reduces each layer equal to them in step(), the op count, and the three integration examples
    # where their extras are installed (SKIP where not). The six checks of a device against the CPU
    # compare the CPU with itself here and say so: they are for a GPU; so are the kernels' bandwidth and
    # NCCL between GPUs.
    installed = {name: importlib.util.find_spec(name) is not None for name in ("transformers", "accelerate", "lightning")}
    examples = 2 * (installed["transformers"] and installed["accelerate"]) + (installed["transformers"] and installed["lightning"])
    assert done.stdout.count("PASS") == 12 + examples and done.stdout.count("SKIP") == 8 + 3 - examples, done.stdout
    assert "run zero_one_adam" not in done.stdout  # --skip runs held
