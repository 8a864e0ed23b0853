"""The collective registry: a collective registered by a module of one's own (tests/collective_plugin.py,
no edit under zoa_train/) is chosen by comm.topology, planned by `plan`, timed by `bench comm` and
trained with by `run`.

The plugin is only imported by those commands (a recipe's `imports`, bench comm's `--imports`), never
into this process, so the other tests see the built-in collectives alone.
"""

import json

import conftest
import pytest
from conftest import env_with_tests_on_path, refused

from zoa_train.comm import registry as collectives

PLUGIN = ["--set", "imports=[collective_plugin]", "--set", "comm.topology=fine_rows"]


def zoa(*args: str):
    """The CLI in a fresh process that can import tests/collective_plugin.py."""
    return conftest.zoa(*args, env=env_with_tests_on_path())


def test_a_plugin_collective_is_planned_beside_the_built_in_ones():
    done = zoa("plan", "recipes/gpt2_tiny.yaml", *PLUGIN, "--nodes", "4", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    planned = json.loads(done.stdout)["zero_one_adam"]
    fine = planned["fine_rows"]
    # a scale per 1,024 elements instead of 4,096: the same rounds, a little more on the wire, more scratch
    assert fine["rounds"] == planned["rounds"] and fine["onebit_allreduces"] == planned["onebit_allreduces"]
    assert planned["bytes_per_rank"] < fine["bytes_per_rank"] < 1.1 * planned["bytes_per_rank"]
    memory, flat = fine["memory_per_rank"], planned["memory_per_rank"]
    assert memory["state_buffers"]["collective._worker"] == flat["state_buffers"]["collective._worker"]
    assert memory["scratch"] > flat["scratch"]
    assert "fine_rows" not in json.loads(done.stdout)["adam"]  # Adam syncs through DDP, not a 1-bit collective


def test_an_unknown_collective_is_refused_with_the_registered_names():
    done = zoa("plan", "recipes/gpt2_tiny.yaml", "--set", "imports=[collective_plugin]", "--set", "comm.topology=coarse_rows")
    refused(done, "comm.topology must be one of auto, flat, hierarchical, fine_rows, not 'coarse_rows'.")
    assert collectives.names() == ("flat", "hierarchical")  # nothing of the plugin's in this process


def test_bench_comm_times_a_plugin_collective():
    done = zoa("bench", "comm", "--imports", "collective_plugin", "--sizes", "5000", "--repeats", "1", "--backend", "gloo", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads(done.stdout)["results"]
    timed = row["collectives"]["fine_rows"]
    assert timed["seconds"] > 0 and timed["bits_per_element"] == 1
    assert row["onebit_bytes_per_rank"] < timed["bytes_per_rank"]  # more row scales than flat's


@pytest.mark.slow  # trains
def test_a_plugin_collective_trains(tmp_path, cache_dir):
    sets = ["train.steps=3", "train.log_every=1", "train.val_batches=1", "train.val_every=0", "logging.wandb=disabled",
            "logging.tensorboard=false", f"data.cache_dir={cache_dir}"]  # fmt: skip
    done = zoa("run", "recipes/gpt2_tiny.yaml", "--out", str(tmp_path / "run"), *PLUGIN, *[a for s in sets for a in ("--set", s)])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fine_rows 1-bit sync, 1 node x 2 ranks" in done.stdout
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
