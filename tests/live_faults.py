"""run_rank with a fault planted in one member's first process, for tests/test_live.py (an entrypoint of
zoa_train.train.live.launch_live: module-level, so that spawned ranks can import it)."""

import os
import signal
import subprocess

from zoa_train.train.trainer import run_rank

FROZEN_S = 12  # well past the heartbeat's STALE_S, well before train.timeout_s (60 s in test_live's runs)


def faulty_rank(faults: dict[int, tuple[str, int]], *args):
    """run_rank(*args); member m of `faults` (not once started again) exits with SIGKILL's code:
    ("round", n): inside its n-th 1-bit round, after the round's first pass (its all-to-all) and before the second;
    ("regroup", n): in its n-th regroup, once the new generation's group is formed and before its state is laid out;
    ("freeze", n): or stops itself with SIGSTOP (its heartbeat thread too) where "round" exits, and is continued
    FROZEN_S later, while the others wait in the round's second pass for it."""
    member = int(os.environ["ZOA_LIVE_MEMBER"])
    if member in faults and os.environ.get("ZOA_LIVE_JOIN") != "1":
        where, n = faults[member]
        calls = [0]

        def dying(real):
            def call(*a, **k):
                calls[0] += 1
                if calls[0] == n and where == "freeze":
                    subprocess.Popen(["sh", "-c", f"sleep {FROZEN_S}; kill -CONT {os.getpid()}"])
                    os.kill(os.getpid(), signal.SIGSTOP)
                elif calls[0] == n:
                    os._exit(137)
                return real(*a, **k)

            return call

        if where in ("round", "freeze"):
            from zoa_train.comm import onebit

            onebit._all_gather = dying(onebit._all_gather)
        else:
            from zoa_train.train.live import LiveTraining

            LiveTraining._rejoin_world = dying(LiveTraining._rejoin_world)
    return run_rank(*args)
