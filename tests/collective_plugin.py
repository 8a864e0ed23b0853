"""A collective registered from outside zoa_train/, as a user's own module would: the flat 1-bit
allreduce with a scale per 1,024 elements instead of 4,096 (a little more on the wire, a closer fit
to each row), named `fine_rows` in recipes that list this module under `imports` and set
comm.topology fine_rows.

tests/test_collective_plugin.py plans it, benchmarks it and trains with it with no edit under
zoa_train/; nothing in zoa_train knows its name.
"""

import functools

from zoa_train.comm import OneBitAllReduce
from zoa_train.comm import registry as collectives
from zoa_train.comm.onebit import flat_onebit_cost, onebit_buffers

SCALE_ROW = 1024


def build(settings: collectives.Settings):
    return functools.partial(OneBitAllReduce, kernels=settings.kernels, scale_row=SCALE_ROW)


collectives.register(
    collectives.CollectiveSpec(
        "fine_rows",
        "fine rows",
        build,
        lambda numel, cluster, size, compress, reduce: flat_onebit_cost(numel, cluster, compress, SCALE_ROW),
        lambda sizes, nodes, ranks_per_node: onebit_buffers(sizes, nodes * ranks_per_node, kernels=None, scale_row=SCALE_ROW),
        state=("_worker", "_server"),
    )
)
