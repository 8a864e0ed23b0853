"""The optimizer registry: an optimizer registered by a module of one's own (tests/sgd_plugin.py, no edit
under zoa_train/) is trained by `run`, planned by `plan`, drawn by `report` and raced by `bench netsim`,
each a real command in its own process; the registry refuses knobs that would clash in the recipe schema.

The plugin is only ever imported by those commands (a recipe's `imports`), never into this process, so
the other tests see the built-in optimizers alone.
"""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import conftest
import pytest
import yaml
from conftest import env_with_tests_on_path, refused
from test_netsim import LATENCY, QUICK, needs_namespaces

from zoa_train import checks
from zoa_train.bench import netsim
from zoa_train.errors import UserError
from zoa_train.optim import registry

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = ["--set", "imports=[sgd_plugin]"]
SGD = [*PLUGIN, "--set", "optimizer.name=sgd"]


def zoa(*args: str) -> subprocess.CompletedProcess:
    """The CLI in a fresh process that can import tests/sgd_plugin.py."""
    return conftest.zoa(*args, env=env_with_tests_on_path())


def short(cache_dir: Path, steps: int) -> list[str]:
    sets = [f"train.steps={steps}", "train.log_every=1", "train.val_batches=1", "train.val_every=0", "train.checkpoint_every=2",
            "logging.wandb=disabled", "logging.tensorboard=false", f"data.cache_dir={cache_dir}"]  # fmt: skip
    return [arg for s in sets for arg in ("--set", s)]


@pytest.fixture(scope="module")
def sgd_run(tmp_path_factory, cache_dir) -> Path:
    tmp = tmp_path_factory.mktemp("sgd")
    run_dir = tmp / "sgd"
    done = zoa("run", "recipes/gpt2_tiny.yaml", "--out", str(run_dir), *SGD, *short(cache_dir, 4))
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


@pytest.mark.slow  # sgd_run trains
def test_a_plugin_optimizer_trains_with_its_own_knobs_and_resumes(sgd_run, cache_dir):
    records = [json.loads(line) for line in (sgd_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    last = records[-1]
    assert last["bits_per_param"] == 16 and last["rounds"] == 4  # gpt2_tiny averages in bf16
    assert last["variance_updates"] == 0
    assert set(last["step_kinds"]) == {"f"}
    resolved = yaml.safe_load((sgd_run / "recipe.yaml").read_text())
    assert resolved["imports"] == ["sgd_plugin"] and resolved["optimizer"]["momentum"] == 0.9 and resolved["optimizer"]["name"] == "sgd"
    # Its state (SGD's momentum buffers) is in the checkpoint: a resumed run continues from step 4 ...
    done = zoa("run", "recipes/gpt2_tiny.yaml", "--out", str(sgd_run), "--resume", "auto", *SGD,
               *short(cache_dir, 6))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (sgd_run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]
    # ... and another optimizer refuses it in one sentence.
    done = zoa("run", "recipes/gpt2_tiny.yaml", "--out", str(sgd_run), "--resume", "auto", *PLUGIN,
               "--set", "optimizer.name=adam", *short(cache_dir, 8))  # fmt: skip
    refused(done, "with optimizer.name adam: the checkpoint was trained with sgd", alone=False)  # the ranks had started


@pytest.mark.parametrize(
    "sets, message",
    [
        ([*SGD, "--set", "optimizer.momentum=-0.5"], "optimizer.momentum must be >= 0, not -0.5."),
        ([*SGD, "--set", "optimizer.nesterov=maybe"], "optimizer.nesterov must be bool"),
        (["--set", "optimizer.name=sgd"], f"optimizer.name must be one of {', '.join(registry.names())}, not 'sgd'."),
        (["--set", "imports=[no_such_module]"], "imports: module no_such_module could not be imported (ModuleNotFoundError"),
    ],
)
def test_bad_plugin_settings_are_one_sentence(tmp_path, sets, message):
    done = zoa("plan", "recipes/gpt2_tiny.yaml", *sets)
    refused(done, message)


def test_plan_counts_the_plugin_beside_the_built_in_optimizers():
    done = zoa("plan", "recipes/gpt2_tiny.yaml", "--world-size", "4", "--json", *PLUGIN)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert list(result) == [*registry.names(), "sgd"]
    steps = result["sgd"]["steps"]
    assert result["sgd"]["rounds"] == steps and result["sgd"]["bits_per_param"] == 16  # bf16 allreduces
    assert result["sgd"]["bytes_per_rank"] == result["adam"]["bytes_per_rank"]  # both one fp32 allreduce a step
    memory = result["sgd"]["memory_per_rank"]  # what the plugin's entry declares: one momentum buffer
    assert memory["state_buffers"] == {"momentum_buffer": memory["params"]} and memory["total"] == 3 * memory["params"] + memory["activations"]
    table = zoa("plan", "recipes/gpt2_tiny.yaml", *PLUGIN)
    assert "SGD (plugin)" in table.stdout and f"SGD (plugin): {steps:,} rounds" in table.stdout


@pytest.mark.slow  # sgd_run trains
def test_report_draws_the_plugin_in_its_own_colour(sgd_run, tmp_path):
    done = zoa("report", str(sgd_run), "--out", str(tmp_path / "report"))
    assert done.returncode == 0, done.stderr
    assert "| sgd | sgd |" in (tmp_path / "report" / "report.md").read_text()
    probe = ("from pathlib import Path; from zoa_train.report import load_runs, styles; "
             f"runs, notes = load_runs([Path({str(sgd_run)!r})]); print(styles(runs)[0]['color'], notes)")  # fmt: skip
    colour = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT / "tests")})  # fmt: skip
    assert colour.stdout.split() == ["#2ca02c", "[]"], colour.stderr


@pytest.mark.slow
@needs_namespaces
def test_bench_netsim_trains_the_plugin_over_the_emulated_links(tmp_path):
    out = tmp_path / "netsim"
    done = zoa("bench", "netsim", "--ranks", "2", "--bandwidth", "100mbit", "--latency", LATENCY, "--steps", "3",
               "--optimizers", "sgd", "--comm-sizes", "none", "--out", str(out), "--json", *QUICK, *PLUGIN)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads(done.stdout.strip().splitlines()[-1])["runs"]
    assert row["optimizer"] == "sgd" and row["steps"] == 3 and row["rounds"] == 3 and row["bits_per_param"] == 16
    assert row["wire_bytes_per_rank"] >= row["bytes_sent_per_rank"] > 0


# ---- in this process: the registry's own rules (nothing here is registered) -------------------------------


def spec(name: str, knobs: type = registry.NoKnobs, **fields) -> registry.OptimizerSpec:
    return registry.OptimizerSpec(name, name, build=lambda ctx: None, plan=lambda ctx: None, knobs=knobs, **fields)


def test_clashing_names_and_knobs_are_refused_before_anything_is_registered():
    before = registry.names()
    with pytest.raises(ValueError, match="registered already"):
        registry.register(spec("adam"))
    with pytest.raises(ValueError, match="knob lr is a key every optimizer has"):
        registry.register(spec("mine", dataclasses.make_dataclass("K", [("lr", float, 0.1)])))
    with pytest.raises(ValueError, match="knob freeze_step has another type or default"):
        registry.register(spec("mine", dataclasses.make_dataclass("K", [("freeze_step", int, 5)])))
    with pytest.raises(ValueError, match="checks knobs it does not have: rank"):
        registry.register(spec("mine", checks={"rank": checks.positive}))
    with pytest.raises(TypeError, match="must be a dataclass"):
        registry.register(spec("mine", knobs=dict))
    assert registry.names() == before and "mine" not in before


def test_knobs_come_from_a_section_or_a_mapping_with_the_library_defaults():
    zero_one = registry.get("zero_one_adam")
    assert zero_one.knobs_from({"local_step_clip": 4}) == zero_one.knobs(local_step_clip=4)
    assert zero_one.knobs_from(object()) == zero_one.knobs()  # nothing set: every default
    assert registry.get("onebit_adam").knobs().freeze_step == 100_000  # OneBitAdam's own default
    with pytest.raises(UserError, match=f"unknown optimizer 'sgd'; the registered ones are {', '.join(registry.names())}"):
        registry.get("sgd")


def test_netsim_trains_every_registered_optimizer_by_default():
    assert netsim.parse_optimizers("all") == list(registry.names())
