"""The bench commands' numbers are bounded and checked against the memory before anything is allocated
(issue 49); the refusals of each flag are cases of tests/test_bad_input.py's COMMAND_CASES. Here, what
those checks count must be what the benches build."""

import math
from pathlib import Path

import pytest
from conftest import refused, zoa_here

from zoa_train.bench.optim import model_numel, model_shapes

RECIPE = str(Path(__file__).resolve().parents[1] / "recipes" / "gpt2_tiny.yaml")


@pytest.mark.parametrize("params_millions", [1e-9, 0.3, 5.0, 25.0, 117.0, 1500.0])
def test_bench_optim_counts_the_parameters_of_the_model_it_builds(params_millions):
    """The memory check counts the model without listing its tensors (for 1e9 million the list alone grew
    by 0.5 GB/s): the same count as the tensors the bench builds."""
    shapes, _ = model_shapes(params_millions)
    assert model_numel(params_millions) == sum(math.prod(shape) for _, shape in shapes)


def test_bench_loader_refuses_micro_batches_that_cannot_be_kept_before_it_reads_them(capsys, cache_dir):
    """The timed micro-batches are kept for the training steps: gpt2_tiny's whole text in each (14 MB),
    10,000 times, is refused once the first is read, before the others are."""
    from zoa_train.bench.limits import available_memory

    if available_memory() > 100e9:
        pytest.skip("this machine could hold 143 GB of micro-batches: nothing to refuse")
    one_rank = ["--set", "train.nproc=1", "--set", "train.global_batch_size=14000"]  # the bench plays rank 0 of the recipe's ranks
    done = zoa_here(
        capsys, "bench", "loader", RECIPE, "--set", f"data.cache_dir={cache_dir}", "--set", "train.micro_batch_size=14000", *one_rank, "--batches", "10000"
    )
    refused(done, "--batches 10,000 micro-batches of 14.34 MB each need about 143.36 GB and there are", "; pass fewer --batches", alone=False)
