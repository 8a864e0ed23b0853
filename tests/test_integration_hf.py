"""zoa_train.integrations.transformers against the real frameworks: ZoaTrainer (a transformers.Trainer)
and the accelerate pattern, each running its example (examples/) on 2 Gloo ranks under real torchrun."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the Hugging Face integration needs transformers")
pytest.importorskip("accelerate", reason="Trainer and the accelerate pattern need accelerate")

from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments  # noqa: E402

from zoa_train.errors import UserError  # noqa: E402
from zoa_train.integrations.transformers import ZoaTrainer, optimizer_section  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HF_EXAMPLE = ROOT / "examples" / "hf_trainer_zero_one_adam.py"
ACCELERATE_EXAMPLE = ROOT / "examples" / "accelerate_zero_one_adam.py"


def torchrun(script: Path, *args: str) -> str:
    """Run `script` on 2 Gloo ranks under torchrun, one thread each; its stdout."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script), *args]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def digests(stdout: str) -> dict[int, str]:
    """Each rank's parameter digest, as the examples print it at the end."""
    found = {int(rank): digest for rank, digest in re.findall(r"rank (\d+): parameter digest ([0-9a-f]+)", stdout)}
    assert sorted(found) == [0, 1], stdout
    return found


def training_logs(output_dir: Path) -> list[dict]:
    """Trainer's log_history (what TensorBoard and W&B get), training step logs only."""
    history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    return [record for record in history if "loss" in record]


def assert_learns(losses: list[float]) -> None:
    """The training losses fall and never climb: each at most 10% above the lowest before it, the last
    at least 0.5 below the first (the examples' short warm-ups diverged without bias correction)."""
    assert len(losses) >= 2 and all(math.isfinite(x) for x in losses), losses
    assert all(x <= 1.1 * min(losses[: i + 1]) for i, x in enumerate(losses)), losses
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.fixture(scope="module")
def zero_one_run(tmp_path_factory) -> tuple[Path, str]:
    """0/1 Adam, 24 steps: variance updates to step 4, then a 1-bit sync every 4 steps; evaluations at 10,
    20 and the end, checkpoints at 12 and 24."""
    out = tmp_path_factory.mktemp("zero_one") / "run"
    return out, torchrun(HF_EXAMPLE, "--output-dir", str(out), "--steps", "24", "--save-steps", "12", "--eval-steps", "10")


@pytest.mark.slow
def test_zoa_trainer_zero_one_adam_ends_on_one_model_below_one_bit(zero_one_run):
    out, stdout = zero_one_run
    first, second = digests(stdout).values()
    assert first == second  # synchronised at the end although the last steps were local ones
    logs = training_logs(out)
    assert [r["step"] for r in logs] == [4, 8, 12, 16, 20, 24]
    assert_learns([r["loss"] for r in logs])
    assert logs[0]["bits_per_param"] == pytest.approx(32.0)  # the warm-up: full-precision variance steps
    assert 0 < logs[-1]["window_bits_per_param"] < 1  # past it: one 1-bit round every 4 steps
    assert logs[-1]["bits_per_param"] < logs[1]["bits_per_param"] < 32
    assert logs[-1]["rounds"] < 24 and logs[-1]["bytes_sent"] > 0
    # By step 12: 4 variance steps, the syncs at 8 and 12, and one that ended the local steps before step 10's evaluation.
    assert logs[2]["step"] == 12 and logs[2]["rounds"] == 7
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    assert [r["step"] for r in history if "eval_loss" in r] == [10, 20, 24]  # and at the end
    for step in (12, 24):
        assert {"zoa_rank_00000.pt", "zoa_rank_00001.pt", "optimizer.pt"} <= {p.name for p in (out / f"checkpoint-{step}").iterdir()}


@pytest.mark.slow
def test_zoa_trainer_resumes_a_checkpoint_exactly(zero_one_run, tmp_path):
    # Resumed inside 0/1 Adam's local-step schedule: each rank must get its own 1-bit error buffers back
    # (from rank 0's optimizer.pt alone the run would continue otherwise).
    out, stdout = zero_one_run
    again = ("--output-dir", str(tmp_path / "resumed"), "--steps", "24", "--save-steps", "12", "--eval-steps", "10")
    resumed = torchrun(HF_EXAMPLE, *again, "--resume", str(out / "checkpoint-12"))
    assert digests(resumed) == digests(stdout)
    assert training_logs(tmp_path / "resumed")[-1] == training_logs(out)[-1]


@pytest.mark.slow
def test_zoa_trainer_onebit_adam_of_its_own_with_bf16_and_accumulation(tmp_path):
    out = tmp_path / "run"
    mode = ("--optimizer", "onebit_adam", "--own-optimizer", "--bf16", "--accumulation", "2")  # optimizers=(OneBitAdam(...), None)
    stdout = torchrun(HF_EXAMPLE, "--output-dir", str(out), "--steps", "12", "--save-steps", "12", *mode)
    first, second = digests(stdout).values()
    assert first == second
    logs = training_logs(out)
    assert logs[-1]["bits_per_param"] < 16  # 4 full-precision warm-up steps, then 1-bit rounds
    assert logs[-1]["window_bits_per_param"] == pytest.approx(1.0)
    assert logs[-1]["rounds"] == 12  # 1-bit Adam communicates at every step
    assert_learns([r["loss"] for r in logs])


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [[], ["--overlap"]], ids=["in_step", "overlapped"])
def test_accelerate_example_without_ddp(tmp_path, overlap):
    stdout = torchrun(ACCELERATE_EXAMPLE, "--steps", "24", "--accumulation", "2", *overlap)
    first, second = digests(stdout).values()
    assert first == second
    windows = [float(w) for w in re.findall(r"window_bits_per_param ([0-9.]+)", stdout)]
    assert len(windows) == 6 and windows[0] == pytest.approx(32.0) and 0 < windows[-1] < 1
    assert_learns([float(x) for x in re.findall(r"^step \d+ loss (\S+)", stdout, re.M)])


ACCELERATE_CHECKPOINT = """
import json, torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel
from zoa_train.integrations.transformers import build_optimizer, load_rank_state, prepare_accelerate, save_rank_state

def own_state(zoa):  # this rank's 1-bit error buffers, flat
    comms = zoa.rank_state_dict()["zoa_rank"]["comms"]
    return torch.cat([t.flatten().float() for c in comms for t in c.values() if torch.is_tensor(t)]).clone()

accelerator = Accelerator(cpu=True)
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0))
zoa = build_optimizer(model, "onebit_adam", freeze_step=2).optimizer
model, optimizer, loader = prepare_accelerate(accelerator, model, zoa, DataLoader(torch.randint(0, 256, (48, 16)), batch_size=4))
for ids in loader:
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
zoa.synchronize()
accelerator.save_state(DIRECTORY)
save_rank_state(zoa, DIRECTORY)
saved = own_state(zoa)
accelerator.wait_for_everyone()  # the other ranks leave save_state before the main process has written: rank 1 once loaded too soon
accelerator.load_state(DIRECTORY)
by_accelerate = own_state(zoa)
load_rank_state(zoa, DIRECTORY)
result = {"rank": accelerator.process_index, "accelerate": torch.equal(by_accelerate, saved), "restored": torch.equal(own_state(zoa), saved)}
with open(f"{DIRECTORY}.rank{accelerator.process_index}.json", "w") as f:  # a file each: the ranks' stdout lines can interleave
    json.dump(result, f)
accelerator.end_training()  # destroys the process group: Gloo threads alive at interpreter exit can abort a rank
"""


@pytest.mark.slow
def test_accelerate_checkpoints_keep_each_ranks_own_state(tmp_path):
    script = tmp_path / "checkpoint.py"
    script.write_text(f"DIRECTORY = {str(tmp_path / 'state')!r}\n" + ACCELERATE_CHECKPOINT)
    torchrun(script)
    results = [json.loads((tmp_path / f"state.rank{rank}.json").read_text()) for rank in (0, 1)]
    # load_state alone gives rank 1 rank 0's error buffers; load_rank_state puts its own back.
    assert results == [{"rank": 0, "accelerate": True, "restored": True}, {"rank": 1, "accelerate": False, "restored": True}]


RANK_DEPENDENT_START = """
import json, torch
from torch.utils.data import DataLoader
from accelerate import Accelerator
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments
from zoa_train.integrations.transformers import ZoaTrainer, build_optimizer, prepare_accelerate

def rank_dependent_model(rank):  # a different initialisation and a buffer of its own on every rank
    torch.manual_seed(rank)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0))
    model.register_buffer("offset", torch.full((2, 3), float(rank)).t())  # non-contiguous
    return model

def digest(model):
    return float(sum(p.double().sum() for p in model.parameters()))

blocks = torch.randint(0, 256, (32, 16), generator=torch.Generator().manual_seed(0))
args = TrainingArguments(output_dir=OUT, max_steps=2, per_device_train_batch_size=4, use_cpu=True, report_to="none",
                         save_strategy="no", disable_tqdm=True, logging_steps=1)
rank = args.process_index
model = rank_dependent_model(rank)
trainer = ZoaTrainer(model=model, args=args, train_dataset=[{"input_ids": b, "labels": b} for b in blocks], zoa_optimizer="onebit_adam")
trainer.train()
result = {"trainer": [model.offset.tolist(), digest(model)]}

accelerator = Accelerator(cpu=True)
model = rank_dependent_model(rank)
zoa = build_optimizer(model, "onebit_adam").optimizer
model, optimizer, loader = prepare_accelerate(accelerator, model, zoa, DataLoader(blocks, batch_size=4))
for ids in loader:
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
result["accelerate"] = [model.offset.tolist(), digest(model)]
with open(f"{OUT}.rank{rank}.json", "w") as f:  # a file each: the ranks' stdout lines can interleave
    json.dump(result, f)
accelerator.end_training()
"""


@pytest.mark.slow
def test_every_rank_starts_from_rank_0s_parameters_and_buffers(tmp_path):
    # As DDP's construction gives: ZoaTrainer and prepare_accelerate over models each rank initialised its own way.
    script = tmp_path / "start.py"
    script.write_text(f"OUT = {str(tmp_path / 'out')!r}\n" + RANK_DEPENDENT_START)
    torchrun(script)
    ranks = [json.loads((tmp_path / f"out.rank{rank}.json").read_text()) for rank in (0, 1)]
    for route in ("trainer", "accelerate"):
        (offset0, params0), (offset1, params1) = ranks[0][route], ranks[1][route]
        assert offset0 == offset1 == [[0.0, 0.0]] * 3, route
        assert params0 == params1, route


# ---- refusals, in this process (one rank) ---------------------------------------------------------


def tiny_model() -> GPT2LMHeadModel:
    return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0))


def arguments(tmp_path: Path, **extra) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **extra)


@pytest.mark.parametrize(
    "extra, kwargs, message",
    [
        ({"fp16": True}, {}, "does not support fp16"),
        ({}, {"lr": 0.1}, "set lr through TrainingArguments (learning_rate)"),
        ({}, {"freeze_step": 3}, "optimizer zero_one_adam has no knob freeze_step"),
        ({}, {"var_freeze_step": 0}, "var_freeze_step must be positive"),
    ],
)
def test_zoa_trainer_refuses_in_one_sentence(tmp_path, extra, kwargs, message):
    with pytest.raises(UserError, match=re.escape(message)):
        ZoaTrainer(model=tiny_model(), args=arguments(tmp_path, **extra), zoa_optimizer="zero_one_adam", zoa_optimizer_kwargs=kwargs)


def test_zoa_trainer_refuses_an_optimizer_that_needs_ddp(tmp_path):
    model = tiny_model()
    with pytest.raises(UserError, match="not AdamW, which needs DDP"):
        ZoaTrainer(model=model, args=arguments(tmp_path), optimizers=(torch.optim.AdamW(model.parameters()), None))


def test_optimizer_section_has_the_registry_defaults():
    section = optimizer_section("zero_one_adam", var_freeze_step=7, betas=[0.8, 0.9])
    assert section.var_freeze_step == 7 and section.betas == (0.8, 0.9)
    assert section.local_step_clip == optimizer_section("zero_one_adam").local_step_clip
