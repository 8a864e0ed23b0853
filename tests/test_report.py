"""`zoa-train report` on two real short runs (adam and 0/1 Adam, 2 Gloo ranks), and what the trainer logs for it:
step_kinds, each rank's memory peaks and MFU (with train.peak_tflops on the 0/1 Adam run, none on adam's)."""

import json
import shutil

import pytest
from conftest import refused, zoa
from test_monitor import gpt2_flops_per_token
from test_run import metrics, short

from zoa_train.step_kinds import STEP_KINDS

pytestmark = pytest.mark.slow  # its fixture trains two runs

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PEAK_TFLOPS = 0.05  # the zoa run's train.peak_tflops
COLUMNS = ["run", "optimizer", "steps", "final loss", "final val loss", "wall time (s)", "bits/param", "rounds", "MB sent/rank"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache_dir):  # noqa: F811
    """Two 8-step runs; 0/1 Adam freezes its variance after step 2 and then takes local steps (interval 3),
    and is told its CPU's peak (train.peak_tflops) so that it logs MFU. Each run's console beside it (NAME.out, NAME.err)."""
    root = tmp_path_factory.mktemp("runs")
    knobs = ("train.log_every=2", "train.val_every=4", "train.checkpoint_every=0", "logging.tensorboard=false")
    for name, extra in {
        "adam": ("optimizer.name=adam",),
        "zoa": (
            "optimizer.name=zero_one_adam",
            "optimizer.var_freeze_step=2",
            "optimizer.local_steps=fixed",
            "optimizer.local_step_interval=3",
            f"train.peak_tflops={PEAK_TFLOPS}",
        ),
    }.items():
        done = zoa("run", "recipes/gpt2_tiny.yaml", "--out", str(root / name), *short(cache_dir, 8, *knobs, *extra))
        assert done.returncode == 0, done.stderr[-3000:]
        (root / f"{name}.out").write_text(done.stdout)
        (root / f"{name}.err").write_text(done.stderr)
    return root


def test_step_kinds_one_character_per_step(runs):
    for name in ("adam", "zoa"):
        records = metrics(runs / name)
        assert [r["step"] for r in records] == [2, 4, 6, 8]
        assert all(len(r["step_kinds"]) == 2 and set(r["step_kinds"]) <= set(STEP_KINDS) for r in records)
    assert "".join(r["step_kinds"] for r in metrics(runs / "adam")) == "ffffffff"  # DDP AdamW: full precision every step
    records = metrics(runs / "zoa")
    kinds = "".join(r["step_kinds"] for r in records)
    assert kinds.startswith("vv") and "v" not in kinds[2:]  # variance updates at steps 0 and 1, then frozen
    assert "l" in kinds and "s" in kinds
    assert kinds.count("v") == records[-1]["variance_updates"]
    assert len(kinds) - kinds.count("l") == records[-1]["rounds"]  # every step but a local one is one round


def test_each_ranks_memory_peak_and_mfu_where_the_peak_is_known(runs):
    from transformers import AutoTokenizer

    for name in ("adam", "zoa"):
        records = metrics(runs / name)
        for r in records:
            assert len(r["mem_peak_bytes_by_rank"]) == 2 and r["mem_peak_bytes"] == max(r["mem_peak_bytes_by_rank"])
            assert all(200e6 < peak < 20e9 for peak in r["mem_peak_bytes_by_rank"])  # a process with torch, its model and data
            assert "mem_reserved_peak_bytes" not in r and "mem_lifetime_peak_bytes" not in r  # CUDA's, and the fallback's
        progress = [line for line in (runs / f"{name}.out").read_text().splitlines() if line.startswith("step ")]
        assert len(progress) == 4 and all(f"  mem {r['mem_peak_bytes'] / 1e9:.2f} GB" in line for line, r in zip(progress, records))

    # adam: a CPU without train.peak_tflops: no MFU, said once
    assert not any("mfu_percent" in r for r in metrics(runs / "adam"))
    assert (runs / "adam.err").read_text().count("MFU is not logged: zoa-train knows no peak FLOPS of a CPU") == 1
    assert " MFU " not in (runs / "adam.out").read_text()

    # zoa: tokens per second per rank x FLOPs per token (by hand) / the peak
    vocab = len(AutoTokenizer.from_pretrained(str(runs / "zoa" / "tokenizer")))
    flops = gpt2_flops_per_token(vocab, 128, 2, 64)
    records = metrics(runs / "zoa")
    for r in records:
        assert r["mfu_percent"] == pytest.approx(100 * r["tokens_per_s"] / 2 * flops / (PEAK_TFLOPS * 1e12), rel=1e-9)
    assert "MFU is not logged" not in (runs / "zoa.err").read_text()
    assert f"  MFU {records[-1]['mfu_percent']:.3g}%" in (runs / "zoa.out").read_text()


def table_rows(report_md: str) -> list[list[str]]:
    lines = [line for line in report_md.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines if not line.startswith("| ---")]


def test_report_writes_plots_and_table(runs, tmp_path):
    # A copy of the adam run without step_kinds and memory stands for a run logged before they existed.
    old = tmp_path / "old_adam"
    old.mkdir()
    shutil.copy(runs / "adam" / "recipe.yaml", old)
    lines = [json.dumps({k: v for k, v in r.items() if k != "step_kinds" and not k.startswith("mem_")}) for r in metrics(runs / "adam")]
    (old / "metrics.jsonl").write_text("\n".join(lines) + "\n")

    out = tmp_path / "report"
    done = zoa("report", str(runs / "adam"), str(runs / "zoa"), str(old), "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("loss.png", "bits_per_param.png", "step_kinds.png", "memory.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000, name
        width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")  # IHDR
        assert width >= 600 and height >= 200, name

    report_md = (out / "report.md").read_text()
    for name in ("loss.png", "bits_per_param.png", "step_kinds.png", "memory.png"):
        assert f"]({name})" in report_md
    assert "old_adam: no step_kinds" in report_md
    assert "old_adam: no mem_peak_bytes in metrics.jsonl" in report_md and report_md.count("no mem_peak_bytes") == 1

    header, *rows = table_rows(report_md)
    finals = {name: metrics(runs / name)[-1] for name in ("adam", "zoa")}
    target = max(r["val_loss"] for r in finals.values())
    assert header == COLUMNS + [f"time to val {target:.3f} (s)", f"step at val {target:.3f}"]
    assert [row[0] for row in rows] == ["adam", "zoa", "old_adam"]
    for row in rows[:2]:
        cells, last = dict(zip(header, row)), finals[row[0]]
        assert cells["optimizer"] == {"adam": "adam", "zoa": "zero_one_adam"}[row[0]]
        assert cells["steps"] == "8"
        assert cells["rounds"] == f"{last['rounds']:,}" and cells["bits/param"] == f"{last['bits_per_param']:.3f}"
        assert cells["final val loss"] == f"{last['val_loss']:.3f}" and cells["final loss"] == f"{last['loss']:.3f}"
        assert cells["MB sent/rank"] == f"{last['bytes_sent'] / 1e6:,.1f}"
        reached = next(r for r in metrics(runs / row[0]) if r.get("val_loss", float("inf")) <= target)
        assert cells[header[-2]] == f"{reached['wall_time']:.1f}" and cells[header[-1]] == str(reached["step"])
    assert dict(zip(header, rows[0]))["bits/param"] == "16.000"  # bf16 gradient allreduce
    assert float(dict(zip(header, rows[1]))["bits/param"]) < 16
    # The same table is printed on the terminal.
    assert "| run | optimizer |" in done.stdout and "| zoa | zero_one_adam |" in done.stdout

    # Runs that logged no memory (all from before it was): no memory plot, and no note on each.
    older = tmp_path / "older"
    assert zoa("report", str(old), "--out", str(older)).returncode == 0
    assert not (older / "memory.png").exists() and "memory.png" not in (older / "report.md").read_text()


def test_report_refuses_a_directory_that_is_not_a_run(runs, tmp_path):
    out = tmp_path / "report"
    done = zoa("report", str(runs / "adam"), str(tmp_path), "--out", str(out))
    refused(done, f"{tmp_path} is not a run directory")
    assert len(done.stderr.strip().splitlines()) <= 2
    assert not out.exists()
