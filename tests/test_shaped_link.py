"""bench comm across an emulated network link (scripts/shaped_link.sh): the regime 1-bit is for.

Needs root and iproute2 (network namespaces, a veth pair, a tc token-bucket filter); skipped
without them. On a 100 Mbit/s link the fp32 allreduce of 1M elements moves 4 MB per rank, the
1-bit one 131 kB (within the filter's burst), so the 1-bit call must win by far more than any CPU
noise could hide.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "shaped_link.sh"


def _can_make_namespaces() -> bool:
    if os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")):
        return False
    probe = f"zoa-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
    if made:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return made


pytestmark = pytest.mark.skipif(not _can_make_namespaces(), reason="needs root, iproute2 and network namespaces")


def test_onebit_allreduce_beats_fp32_on_a_100mbit_link():
    done = subprocess.run(
        [str(SCRIPT), "100mbit", "--sizes", "1M", "--repeats", "3", "--json"],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    (row,) = result["results"]
    assert result["nproc"] == 2 and row["numel"] == 1 << 20
    assert row["fp32_bytes_per_rank"] == 4 << 20 and row["onebit_bytes_per_rank"] < (4 << 20) / 30
    # 4 MB at 100 Mbit/s, less the filter's 1 MB burst, is at least 0.24 s whatever the CPU does
    assert row["allreduce_fp32_s"] > 0.2
    assert row["speedup"] > 5


def test_script_refuses_a_missing_rate():
    done = subprocess.run([str(SCRIPT), "--sizes", "1M"], capture_output=True, text=True)
    assert done.returncode == 2 and "usage" in done.stderr
