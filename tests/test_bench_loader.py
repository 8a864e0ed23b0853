"""`zoa-train bench loader`: one rank's loader in tokens/s against the trainer's consumption per rank on the recipe."""

import json
from pathlib import Path

import pytest
from conftest import zoa_here

RECIPE = str(Path(__file__).resolve().parents[1] / "recipes" / "gpt2_tiny.yaml")


def bench(capsys, cache_dir, *extra: str) -> dict:
    # gpt2_tiny's 2 ranks at a global batch of 64: rank 0 takes 32 samples of 64 tokens a step, as 2 micro-batches of 16
    done = zoa_here(capsys, "bench", "loader", RECIPE, "--set", f"data.cache_dir={cache_dir}", "--set", "train.global_batch_size=64", "--json", *extra)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_bench_loader_sets_a_rank_s_tokens_per_second_against_the_recipe_s_tokens_per_step_over_a_given_step_time(capsys, cache_dir):
    r = bench(capsys, cache_dir, "--batches", "4", "--step-time", "250ms")
    assert (r["unit"], r["world_size"], r["accumulation"], r["units_per_step_per_rank"]) == ("tokens", 2, 2, 32 * 64)
    assert r["step_time"] == "given" and r["step_s"] == 0.25 and r["trainer_units_per_s_per_rank"] == pytest.approx(32 * 64 / 0.25)
    assert r["loader_units_per_s_per_rank"] == pytest.approx(16 * 64 / r["loader_s_per_batch"])
    assert r["loader_over_trainer"] == pytest.approx(r["loader_units_per_s_per_rank"] / r["trainer_units_per_s_per_rank"])


def test_bench_loader_measures_a_step_of_the_rank_s_micro_batches_without_a_step_time(capsys, cache_dir):
    r = bench(capsys, cache_dir, "--batches", "2")
    assert r["step_time"] == "measured" and r["step_threads"] >= 1 and r["step_s"] > 0
    assert r["trainer_units_per_s_per_rank"] == pytest.approx(32 * 64 / r["step_s"])
