"""zoa_train.integrations.lightning against real Lightning: the example (examples/lightning_zero_one_adam.py)
on 2 Gloo ranks under torchrun with SelfSyncingStrategy, and its refusals in one sentence."""

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning", reason="the Lightning integration needs lightning (pip install 'zoa-train[lightning]')")
pytest.importorskip("transformers", reason="the Lightning example's tiny GPT-2 needs transformers")

import lightning.pytorch as pl  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

from zoa_train.errors import UserError  # noqa: E402
from zoa_train.integrations.lightning import RANK_STATES, SelfSyncingStrategy  # noqa: E402

# CI installs Slurm for its own tests; Lightning then suggests srun for these in-process Trainers.
pytestmark = pytest.mark.filterwarnings("ignore:The `srun` command is available on your system")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "lightning_zero_one_adam.py"
WARM_UP = 8  # the example's 0/1 Adam: variance updates at steps 0-3, a 1-bit sync every 4 steps from then; one epoch is 8 steps


def torchrun(*args: str) -> str:
    """Run the example on 2 Gloo ranks under torchrun, one thread each; its stdout."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(EXAMPLE), *args]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def final_parameters(out: Path) -> list[dict[str, torch.Tensor]]:
    """Each rank's parameters at the end, as the example saves them."""
    return [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in (0, 1)]


def assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, different


def step_logs(out: Path) -> dict[int, dict[str, float]]:
    """CSVLogger's training rows (what every Lightning logger gets), by step."""
    with open(out / "metrics.csv") as f:
        return {int(row["step"]): {k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f) if row.get("bits_per_param")}


def assert_learns(losses: list[float]) -> None:
    """The training losses fall and never climb: each at most 10% above the lowest before it, the last
    at least 0.5 below the first (the examples' short warm-ups diverged without bias correction)."""
    assert len(losses) >= 2 and all(math.isfinite(x) for x in losses), losses
    assert all(x <= 1.1 * min(losses[: i + 1]) for i, x in enumerate(losses)), losses
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.fixture(scope="module")
def zero_one_run(tmp_path_factory) -> Path:
    """0/1 Adam, 3 epochs of 8 steps, a checkpoint at the end of each."""
    out = tmp_path_factory.mktemp("lightning_zero_one") / "run"
    torchrun("--out", str(out), "--epochs", "3")
    return out


@pytest.mark.slow
def test_zero_one_adam_ends_on_one_model_below_one_bit(zero_one_run):
    assert_identical(*final_parameters(zero_one_run))
    logs = step_logs(zero_one_run)
    assert sorted(logs) == list(range(24))
    assert_learns([logs[step]["loss"] for step in sorted(logs)])
    assert logs[0]["bits_per_param"] == 32.0 and logs[0]["rounds"] == 1  # step 0 updates the variance: a full-precision round
    last = logs[23]
    past_warm_up = (last["total_bits_per_param"] - logs[WARM_UP - 1]["total_bits_per_param"]) / (23 - (WARM_UP - 1))
    assert 0 < past_warm_up < 1  # 1-bit syncs every 4 steps, local steps between (checkpoint syncs included)
    assert last["rounds"] < 24 and last["variance_updates"] == 4 and last["bytes_sent"] > 0


@pytest.mark.slow
def test_checkpoints_carry_every_ranks_own_state(zero_one_run):
    checkpoint = torch.load(zero_one_run / "checkpoints" / "epoch=0.ckpt", weights_only=False)
    state = checkpoint["optimizer_states"][0]
    ranks = state[RANK_STATES]
    assert [r["zoa_rank"]["rank"] for r in ranks] == [0, 1]
    errors = [r["zoa_rank"]["comms"] for r in ranks]
    assert repr(errors[0]) != repr(errors[1])  # each rank's 1-bit error buffers are its own


@pytest.mark.slow
def test_resume_from_a_lightning_checkpoint_equals_the_uninterrupted_run(zero_one_run, tmp_path):
    out = tmp_path / "resumed"
    torchrun("--out", str(out), "--epochs", "3", "--resume", str(zero_one_run / "checkpoints" / "epoch=0.ckpt"))
    resumed = final_parameters(out)
    assert_identical(*resumed)
    assert_identical(resumed[0], final_parameters(zero_one_run)[0])
    assert step_logs(out)[23] == step_logs(zero_one_run)[23]  # the ledger resumed too


@pytest.mark.slow
def test_onebit_adam_with_bf16_gradient_accumulation_and_clipping(tmp_path):
    """1-bit Adam, 256 blocks in batches of 4 accumulated 2 at a time, gradients clipped: 16 steps, full precision up to step 4."""
    out = tmp_path / "onebit"
    torchrun(
        "--out",
        str(out),
        "--optimizer",
        "onebit_adam",
        "--epochs",
        "1",
        "--samples",
        "256",
        "--batch-size",
        "4",
        "--accumulate",
        "2",
        "--precision",
        "bf16-mixed",
        "--clip",
        "1.0",
    )
    assert_identical(*final_parameters(out))
    logs = step_logs(out)
    assert sorted(logs) == list(range(16))
    assert logs[15]["bits_per_param"] < 16 and logs[15]["rounds"] == 16
    assert_learns([logs[step]["loss"] for step in sorted(logs)])


class Linear(pl.LightningModule):
    def __init__(self, optimizer):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.make_optimizer = optimizer

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return self.make_optimizer(self.parameters())


def fit_one_rank(monkeypatch, tmp_path, optimizer, **trainer_kwargs) -> None:
    """Fit `Linear` in this process on one CPU rank; Lightning's launcher sets these variables, put back after."""
    for name in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "PL_GLOBAL_SEED"):
        monkeypatch.delenv(name, raising=False)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)
    trainer = pl.Trainer(
        strategy=SelfSyncingStrategy(),
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        **trainer_kwargs,
    )
    try:
        trainer.fit(Linear(optimizer), data)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize(
    "trainer_kwargs, message",
    [
        # Lightning turns precision="16-mixed" on CPU into bf16-mixed: the plugin itself, as on a GPU.
        ({"plugins": [MixedPrecision(precision="16-mixed", device="cpu")]}, "does not support precision 16-mixed"),
        ({"precision": "bf16-true"}, "trains in precision 32-true or bf16-mixed, not bf16-true"),
        ({"sync_batchnorm": True}, "does not support sync_batchnorm=True"),
    ],
)
def test_refuses_settings_the_optimizers_cannot_honour(monkeypatch, tmp_path, trainer_kwargs, message):
    from zoa_train.optim import ZeroOneAdam

    with pytest.raises(UserError, match=message):
        fit_one_rank(monkeypatch, tmp_path, ZeroOneAdam, **trainer_kwargs)


def test_refuses_an_optimizer_that_needs_ddp(monkeypatch, tmp_path):
    with pytest.raises(UserError, match="not AdamW, which needs DDP"):
        fit_one_rank(monkeypatch, tmp_path, torch.optim.AdamW)


def test_refuses_ddp_wrapper_arguments():
    with pytest.raises(UserError, match="takes no find_unused_parameters"):
        SelfSyncingStrategy(find_unused_parameters=True)


RANK_BUFFER_SCRIPT = """
import sys
import lightning.pytorch as pl
import torch
import torch.distributed as dist
from zoa_train.integrations.lightning import SelfSyncingStrategy
from zoa_train.optim import ZeroOneAdam

class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        rank = int(__import__("os").environ["RANK"])
        torch.manual_seed(rank)  # every rank its own initialisation, as without seed_everything
        self.layer = torch.nn.Linear(4, 1)
        self.register_buffer("scale", torch.full((3,), float(rank + 1)))

    def training_step(self, batch, batch_idx):
        return (self.layer(batch[0]) * self.scale[0]).pow(2).mean()

    def configure_optimizers(self):
        return ZeroOneAdam(self.parameters(), lr=1e-2, var_freeze_step=1)

data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 4)), batch_size=4)
trainer = pl.Trainer(strategy=SelfSyncingStrategy(), accelerator="cpu", devices=2, max_steps=2, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
model = Model()
trainer.fit(model, data)
torch.save(model.state_dict(), sys.argv[1] + f"/state{dist.get_rank()}.pt")
"""


@pytest.mark.slow
def test_every_rank_starts_from_rank_zeros_parameters_and_buffers(tmp_path):
    """As under DDP: a model initialised differently on each rank trains from rank 0's parameters and buffers."""
    script = tmp_path / "rank_buffers.py"
    script.write_text(RANK_BUFFER_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script), str(tmp_path)]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    states = [torch.load(tmp_path / f"state{rank}.pt", weights_only=True) for rank in (0, 1)]
    assert_identical(*states)
    assert torch.equal(states[0]["scale"], torch.full((3,), 1.0))  # rank 0's buffer
