"""train.elastic live: ranks leave and join a running job without the others restarting.

Between two syncs the ranks of 0/1 Adam, 1-bit Adam and DiLoCo do not talk to each other, so a lost
rank shows up at the next collective, and the job can go on there with the ranks it still has. The
pieces, each rank's side (`LiveMembership`) and the launcher's (`launch_live`):

- **A store that outlives every rank.** `zoa-train run` keeps a TCP store in its own process and starts
  the ranks itself; each rank has a member id (its first rank) that it keeps across restarts.
- **Generations.** Each membership is a generation g with its members in rank order; its process group
  meets under the store prefix `zoa_live/g/`, so nothing of an earlier generation is read again.
- **Commits.** Every collective of the training loop runs as one numbered call of the generation
  (`Trainer._survive`). A rank that finished it adds itself to the call's count; the last to add
  decides "done", a rank whose collective failed decides "failed" (compare-and-set: the first decision
  holds). Every rank waits for the decision, so the ranks never disagree on whether a call happened,
  even when a dead rank completed it for some of them and not for others. A failed call is undone
  (the optimizer step restores what it changed) and run again in the next generation.
- **Leaving.** After a failed call the survivors close their process groups (which wakes any rank still
  waiting in one), arrive in the store, and the first to arrive waits until every member has arrived
  or is gone: its process ended (the launcher marks it dead at once) or its heartbeat is older than
  STALE_S (a hung or unreachable rank, after its collectives have timed out). The arrived form the
  next generation.
- **Joining.** A rank started again (or a new one) asks to join and waits; the members see the request
  at a step boundary, agree on a step a local-step period ahead (as for a stop), synchronise there and
  form the next generation with it; rank 0 then sends it the model, the optimizer state and the
  trainer's position (train/trainer.py).
"""

import contextlib
import copy
import json
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from zoa_train.config import check_batch_layout
from zoa_train.data.prefetch import DevicePrefetcher
from zoa_train.distributed import STOP_SIGNALS, LauncherSignalled, RankFailed, rank_threads
from zoa_train.tasks import build_task
from zoa_train.train.metrics import MetricsLogger

log = logging.getLogger(__name__)

PREFIX = "zoa_live"
STORE_WAIT_S = 300  # how long a launcher waits for machine 0's store
BEAT_S = 0.5  # how often a rank writes its heartbeat
CHECK_S = 0.05  # how often a rank waiting for a call's decision looks for members that are gone
STALE_S = 5.0  # a member whose heartbeat is older is gone (hung, or its host lost)
MEMBER_ENV, JOIN_ENV = "ZOA_LIVE_MEMBER", "ZOA_LIVE_JOIN"


class Dropped(RuntimeError):
    """This rank was left out of the next generation (it arrived too late): it stops, and its launcher
    may start it again, as a rank that joins."""


class LiveMembership:
    """One rank's place in a live job: its member id, the generation and its members (ids in rank order)."""

    def __init__(self, backend: str, timeout_s: float):
        self.backend, self.timeout = backend, timedelta(seconds=timeout_s)
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        self.store = dist.TCPStore(host, port, is_master=False, timeout=self.timeout)
        self._beat_store = dist.TCPStore(host, port, is_master=False, timeout=self.timeout)  # the heartbeat thread's own connection
        self.id = int(os.environ[MEMBER_ENV])
        self.joining = os.environ.get(JOIN_ENV) == "1"
        self.generation, self.members = 0, list(range(int(os.environ["WORLD_SIZE"])))
        self.joins_seen = 0  # join requests admitted so far (the store's counter)
        self._seq = 0  # the generation's numbered calls so far
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the generation and its connections, between the main and the heartbeat thread
        self._connections: dict[int, str] = {}

    # ---- the process group of a generation ----------------------------------------------------------

    def start(self) -> bool:
        """Join the first generation, or (a rank started again) wait to be admitted to a later one; False
        when the run ended first. Initialises torch.distributed's default group."""
        if self.joining:
            self.store.delete_key(f"{PREFIX}/admitted/{self.id}")  # an earlier process's admission
            n = self.store.add(f"{PREFIX}/joins", 1)
            self.store.set(f"{PREFIX}/join/{n}", str(self.id))
            key = f"{PREFIX}/admitted/{self.id}"
            waited = time.monotonic()
            while not self.store.check([key]):
                if self.store.check([f"{PREFIX}/done"]):
                    return False
                if time.monotonic() - waited > STALE_S and self._nobody_to_admit():
                    log.warning("member %d: no member of the run is left to admit it", self.id)
                    return False
                time.sleep(0.1)
            generation = int(self.store.get(key))
            record = json.loads(self.store.get(f"{PREFIX}/{generation - 1}/next"))
            self.members, self.joins_seen, self.generation = record["members"], record["joins_seen"], generation
            self.store.delete_key(f"{PREFIX}/dead/{self.id}")  # the launcher's mark of this member's last process
        # Beating from here on: a rank waiting to join is not a member, and a member that waits for one of its
        # ids' heartbeat (a lost rank's, started again) must find it stale or marked dead.
        self._beat(self._beat_store)
        threading.Thread(target=self._beating, name="zoa-live-heartbeat", daemon=True).start()
        import torch._dynamo  # noqa: F401  (before the group: see distributed.init_process_group)

        self._init_group()
        return True

    def _init_group(self) -> None:
        self._seq = 0
        with self._lock:
            self._connections = {}  # the last generation's, shut already
        with self.making_groups():  # Gloo's connections, made by the init
            dist.init_process_group(
                self.backend,
                store=dist.PrefixStore(f"{PREFIX}/{self.generation}/group", self.store),
                rank=self.members.index(self.id),
                world_size=len(self.members),
                timeout=self.timeout,
            )
        self.store.set(f"{PREFIX}/current", json.dumps(self.members))  # what a rank waiting to join looks at (the same on every member)

    @contextlib.contextmanager
    def making_groups(self):
        """Process groups made inside (a node-aware sync's node groups, the checkpoint writer's) belong to the
        generation: their connections are shut down with the world group's. A rank waiting on another inside one
        of them (a node-aware round) is freed as one waiting in the world group is."""
        before = _sockets()
        yield
        with self._lock:
            self._connections |= {fd: link for fd, link in _sockets().items() if before.get(fd) != link}

    def _nobody_to_admit(self) -> bool:
        """Whether every member of the newest generation is gone (a rank waiting to join then gives up)."""
        return all(self._gone(m) for m in json.loads(self.store.get(f"{PREFIX}/current")))

    def _close_connections(self, generation: int | None = None) -> None:
        """Shut this generation's Gloo connections down (if it is still `generation`), so that a collective
        waiting on them, this rank's or another member's, fails at once rather than after train.timeout_s.
        (Destroying the group does not close them: torch keeps references to the world group.) Their
        listening socket is left to Gloo."""
        with self._lock:
            if generation is not None and generation != self.generation:
                return
            connections, self._connections = self._connections, {}
        for fd, link in _sockets().items():
            if connections.get(fd) != link:
                continue
            try:
                connection = socket.socket(fileno=fd)
            except OSError:
                continue  # closed by Gloo since it was listed
            try:
                if not connection.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # closed by Gloo meanwhile
            finally:
                connection.detach()  # the descriptor stays Gloo's

    def _key(self, name: str) -> str:
        return f"{PREFIX}/{self.generation}/{name}"

    # ---- commits ------------------------------------------------------------------------------------

    def next_call(self) -> int:
        self._seq += 1
        return self._seq

    def commit(self, call: int) -> bool:
        """This rank finished `call`: whether every member did (True), or the call failed somewhere (False)."""
        decision = self._key(f"call/{call}")
        if self.store.add(decision + "/count", 1) == len(self.members):
            self.store.compare_set(decision, "", "done")
        looked = time.monotonic()
        while not self.store.check([decision]):  # polled: the others finish the collective within moments
            if time.monotonic() - looked > CHECK_S:
                if self._gone_members():  # one died after its collective, before adding itself
                    return self.fail(call)
                looked = time.monotonic()
            time.sleep(0.001)
        return self.store.get(decision) == b"done"

    def fail(self, call: int) -> bool:
        """This rank's collective of `call` failed: decide "failed" unless it was decided already, and tell every
        member that the generation ends (their heartbeat threads close their connections, which frees a member
        waiting in a collective on a hung one)."""
        done = self.store.compare_set(self._key(f"call/{call}"), "", "failed") == b"done"
        if not done:
            self.store.set(self._key("failed"), "1")
        return done

    # ---- membership changes -------------------------------------------------------------------------

    def _beating(self) -> None:
        """Every BEAT_S: this rank's heartbeat; a look at the next member's (each rank watches one, so a hung rank
        is seen within STALE_S even while every other rank waits in a collective with it), which marks the
        generation failed; and, once it is marked, this rank's connections shut, which ends its own wait."""
        while not self._stop.wait(BEAT_S):
            with contextlib.suppress(Exception):  # the store is gone: the run is over
                self._beat(self._beat_store)
                generation, members = self.generation, self.members
                if not self._connections or self.id not in members:
                    continue
                failed = f"{PREFIX}/{generation}/failed"
                neighbour = members[(members.index(self.id) + 1) % len(members)]
                if neighbour != self.id and self._gone(neighbour, self._beat_store):
                    self._beat_store.set(failed, "1")
                if self._beat_store.check([failed]):
                    self._close_connections(generation)

    def _beat(self, store) -> None:
        store.set(f"{PREFIX}/beat/{self.id}", json.dumps({"t": time.time(), "host": socket.gethostname(), "pid": os.getpid()}))

    def _gone(self, member: int, store=None) -> bool:
        """Whether `member`'s process ended (its launcher's mark) or its heartbeat is older than STALE_S."""
        store = store or self.store  # the heartbeat thread passes its own connection
        beat = f"{PREFIX}/beat/{member}"
        if store.check([f"{PREFIX}/dead/{member}"]) or not store.check([beat]):
            return True
        beat = json.loads(store.get(beat))
        return time.time() - beat["t"] > STALE_S

    def _gone_members(self) -> list[int]:
        return [m for m in self.members if m != self.id and self._gone(m)]

    def regroup_after_loss(self) -> list[int]:
        """After a failed call: close this generation's process groups, agree on the survivors and form the
        next generation with them; returns the member ids that left (none: every member was still there, a
        false alarm or a failure that was not a lost rank). Raises Dropped if this rank is not among them."""
        self._close_connections()  # a member still waiting in a collective with this rank fails at once
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        self.store.set(self._key(f"arrived/{self.id}"), "1")
        self.store.set(self._key("failed"), "1")
        if self.store.add(self._key("decider"), 1) == 1:
            # a member still in a collective is freed when the heartbeat thread closes its connections, or by its timeout
            deadline = time.monotonic() + self.timeout.total_seconds() + 2 * STALE_S
            while True:
                arrived = [m for m in self.members if self.store.check([self._key(f"arrived/{m}")])]
                missing = [m for m in self.members if m not in arrived]
                if all(self._gone(m) for m in missing) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            self.store.set(self._key("next"), json.dumps({"members": arrived, "joins_seen": self.joins_seen}))
        record = json.loads(self.store.get(self._key("next")))
        left = [m for m in self.members if m not in record["members"]]
        if self.id not in record["members"]:
            raise Dropped(f"member {self.id} arrived after the others had formed generation {self.generation + 1} without it")
        self.members, self.generation = record["members"], self.generation + 1
        self._init_group()
        return left

    def pending_joins(self) -> bool:
        """Whether a rank waits to join (one store round trip)."""
        return self.store.add(f"{PREFIX}/joins", 0) > self.joins_seen

    def agreed_step(self, proposal: int) -> int:
        """The step at which the members admit the waiting ranks: the first proposal (a step no member has passed)."""
        return int(self.store.compare_set(self._key("admit_at"), "", str(proposal)))

    def admission_step(self) -> int | None:
        key = self._key("admit_at")
        return int(self.store.get(key)) if self.store.check([key]) else None

    def regroup_with_joiners(self) -> list[int]:
        """At the agreed step, every member: form the next generation with the ranks waiting to join (rank 0
        decides which); returns their ids."""
        if self.members[0] == self.id:
            upto = self.store.add(f"{PREFIX}/joins", 0)
            joiners = [int(self.store.get(f"{PREFIX}/join/{n}")) for n in range(self.joins_seen + 1, upto + 1)]
            joiners = [j for j in dict.fromkeys(joiners) if j not in self.members]
            self.store.set(self._key("next"), json.dumps({"members": self.members + joiners, "joins_seen": upto}))
            for j in joiners:
                self.store.set(f"{PREFIX}/admitted/{j}", str(self.generation + 1))
        record = json.loads(self.store.get(self._key("next")))
        joined = [m for m in record["members"] if m not in self.members]
        self._close_connections()  # every member has committed its last call of this generation
        dist.destroy_process_group()
        self.members, self.joins_seen, self.generation = record["members"], record["joins_seen"], self.generation + 1
        self._init_group()
        return joined

    def finish(self) -> None:
        """The run is over: ranks still waiting to join give up."""
        with contextlib.suppress(Exception):
            self.store.set(f"{PREFIX}/done", "1")
        self._stop.set()


def _sockets() -> dict[int, str]:
    """This process's socket descriptors and what each is ("socket:[inode]"), from /proc (Linux)."""
    found = {}
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/self/fd/{fd}")
                if link.startswith("socket:"):
                    found[int(fd)] = link
    return found


# ---- the launcher -------------------------------------------------------------------------------


def _live_rank(member: int, world: int, local_world: int, host: str, port: int, joining: bool, results, entrypoint, args) -> None:
    os.environ.update(
        {
            MEMBER_ENV: str(member),
            JOIN_ENV: "1" if joining else "0",
            "RANK": str(member),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(member % local_world),
            "LOCAL_WORLD_SIZE": str(local_world),
            "MASTER_ADDR": host,
            "MASTER_PORT": str(port),
        }
    )
    for sig in STOP_SIGNALS:  # until the trainer installs its handler: a stop before then ends the rank
        signal.signal(sig, signal.SIG_DFL)
    try:
        results.put((member, entrypoint(*args)))
    except Dropped as e:  # the launcher starts it again if --max-restarts allows
        print(f"zoa-train: {e}", file=sys.stderr, flush=True)
        sys.exit(1)


def launch_live(entrypoint, nproc: int, *args, max_restarts: int = 0, nnodes: int = 1, node_rank: int = 0, store_at: str | None = None) -> list:
    """Run entrypoint(*args) on `nproc` local ranks (train.elastic live), machine `node_rank` of `nnodes`: member ids
    node_rank x nproc onwards. They meet in a store that machine 0's launcher keeps, at `store_at` (HOST:PORT; on
    one machine a free port of 127.0.0.1). A rank that fails is started again as a rank that joins, up to
    `max_restarts` times in all, while the others go on; a launcher started once the run is under way (a machine
    that comes back) starts its ranks as ranks that join. Returns this machine's ranks' results, the one holding
    the run's summary first."""
    host, _, port = (store_at or "127.0.0.1:0").rpartition(":")
    store = dist.TCPStore(host, int(port), is_master=node_rank == 0, wait_for_workers=False, timeout=timedelta(seconds=STORE_WAIT_S))
    under_way = store.check([f"{PREFIX}/current"])  # a machine that comes back: its ranks join
    context = multiprocessing.get_context("spawn")
    results = context.SimpleQueue()

    def start(member: int, again: bool):
        rank_args = (member, nnodes * nproc, nproc, host, store.port, again, results, entrypoint, args)
        process = context.Process(target=_live_rank, args=rank_args, daemon=False)
        process.start()
        return process

    stopped: list[int] = []

    def pass_on(signum, frame):
        stopped.append(signum)
        for process in running.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signum)

    with rank_threads(nproc):  # read by the ranks as they start
        running = {member: start(member, under_way) for member in range(node_rank * nproc, (node_rank + 1) * nproc)}
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, pass_on) for sig in STOP_SIGNALS} if in_main_thread else {}
    collected: dict[int, object] = {}
    restarts, failure, finished_at = 0, None, None
    try:
        while running:
            while not results.empty():
                member, result = results.get()
                collected[member] = result
            for member, process in list(running.items()):
                if process.exitcode is None:
                    continue
                del running[member]
                if process.exitcode == 0:
                    finished_at = finished_at or time.monotonic()
                    continue
                store.set(f"{PREFIX}/dead/{member}", "1")  # the others need not wait for its heartbeat to age
                if finished_at is None and not stopped and restarts < max_restarts:
                    restarts += 1
                    with rank_threads(nproc):
                        running[member] = start(member, True)  # it clears its mark once admitted
                elif failure is None and finished_at is None:
                    failure = f"rank {member} exited with code {process.exitcode}"
            time.sleep(0.1)
        while not results.empty():
            member, result = results.get()
            collected[member] = result
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for process in running.values():
            process.kill()
    if stopped:
        raise LauncherSignalled(stopped[0])
    ordered = sorted(collected.values(), key=lambda r: not (isinstance(r, dict) and "run_dir" in r))
    if failure is not None and not any(isinstance(r, dict) for r in ordered):
        raise RankFailed(failure)
    return ordered or [None]


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]


class RunOver(Exception):
    """A rank that waited to join a live run found it over."""


class LiveTraining:
    """The trainer's side of train.elastic live: a mixin of Trainer (train/trainer.py), whose state it reads
    and replaces when the membership changes. Without train.elastic live (`self.live` None) `_survive`
    only calls its function."""

    live: LiveMembership | None
    _synced_at = 0  # the last step after which every rank held the same parameters
    _false_alarms = 0  # regroups in a row that found every member there

    def _survive(self, fn, undo: bool = False):
        """fn(), which runs collectives of the training loop. Under train.elastic live it is one numbered call of
        the generation: if it failed on any rank (a rank was lost), every rank undoes what it changed (with
        `undo`: the model, the gradients and the optimizer's state, as they were before it), the survivors
        form the next generation, and fn() runs again among them."""
        if self.live is None:
            return fn()
        while True:
            saved = self._snapshot() if undo else None
            call, began = self.live.next_call(), time.monotonic()
            try:
                result = fn()
                if self.live.commit(call):
                    self._false_alarms = 0
                    return result
                error = RuntimeError("a rank was lost after the collective")
            except RuntimeError as e:  # Gloo's errors, torch.distributed's DistError
                log.info("member %d: call %d failed after %.2f s: %s", self.live.id, call, time.monotonic() - began, _first_line(e))
                if self._refused_elsewhere():
                    raise  # a rank stopped on bad input: run_rank reports its sentence
                self.live.fail(call)
                error = e
            if saved is not None:
                self._restore(saved)
            self._regroup_after_loss(began, error, self.step + 1 if undo else self.step)

    def _making_groups(self):
        """Where the trainer makes process groups of its own: under train.elastic live they belong to the generation."""
        return self.live.making_groups() if self.live is not None else contextlib.nullcontext()

    def _snapshot(self) -> tuple:
        state = copy.deepcopy(self.opt.optimizer.state_dict())
        model = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        return model, [None if p.grad is None else p.grad.detach().clone() for p in self.params], state

    def _restore(self, saved: tuple) -> None:
        model, grads, state = saved
        self.model.load_state_dict(model)
        for p, grad in zip(self.params, grads):
            p.grad = grad
        self.opt.optimizer.load_state_dict(state)

    def _regroup_after_loss(self, began: float, error: Exception, step: int) -> None:
        """Form the next generation with the survivors and lay the run out over it; one metrics record."""
        before, left = self.world, []
        self._settle_save()
        while True:
            try:
                lost = self.live.regroup_after_loss()
                left += lost
                if lost or self._false_alarms < 2:
                    self._rejoin_world(broadcast=False)
            except Dropped:
                raise
            except RuntimeError as e:  # another rank lost while regrouping: again, without it
                if self._refused_elsewhere():
                    raise
                log.warning("a rank was lost while the others regrouped (%s); regrouping again", _first_line(e))
                continue
            if lost:
                break
            # Every member was there: a rank thought lost (its heartbeat late on a loaded host) was not, or the call
            # failed for another reason, which would fail again: run again twice, then raised.
            self._false_alarms += 1
            if self._false_alarms > 2:
                raise error
            log.warning("a call failed and no rank was lost (%s); the ranks regrouped", _first_line(error))
            break
        if not left:
            return
        dropped = max(0, step - self._synced_at)  # the lost ranks' steps since the last sync, which no survivor holds
        per_rank = self.recipe.train.global_batch_size // before
        record = self._membership_record(before, began, left_members=left, steps_dropped=dropped, samples_dropped=dropped * per_rank * len(left))
        if self.is_main:
            log.warning(
                "member(s) %s left at step %d: %d ranks go on (%.2f s); their last %d step(s) since the last sync are dropped",
                ", ".join(map(str, left)),
                step,
                self.world,
                record["seconds_down"],
                dropped,
            )
            self.metrics.log(record)

    def admit_joiners(self) -> None:
        """At a step boundary: admit the ranks waiting to join, at a step every member agreed on (one store round
        trip a step until one waits): the members synchronise there, form the next generation with them, and
        rank 0 sends them the run's state."""
        at = self.live.admission_step()
        if at is None:
            if not self.live.pending_joins():
                return
            at = self.live.agreed_step(self.step + self.opt.max_steps_apart + 1)
        if self.step < at:
            return
        began, before = time.monotonic(), self.world
        if self.opt.parameters_differ:
            self._survive(self.opt.synchronize, undo=True)
        self._settle_save()
        joined = self.live.regroup_with_joiners()
        self._rejoin_world(broadcast=True)
        self.exchange_state()
        self._synced_at = self.step
        if self.is_main:
            log.warning("member(s) %s joined at step %d: %d ranks go on", ", ".join(map(str, joined)), self.step, self.world)
            self.metrics.log(self._membership_record(before, began, joined_members=joined))

    def _membership_record(self, before: int, began: float, **change) -> dict:
        """The metrics record of a membership change: the world sizes, the seconds it took, and whether the 1-bit sync
        is node-aware now (comm.topology auto re-chooses at each change: flat while the nodes are uneven)."""
        return {
            "step": self.step,
            "world_size": self.world,
            "world_size_before": before,
            **change,
            "seconds_down": round(time.monotonic() - began, 3),
            "node_aware": int(self.sync.spec.node_aware),
        }

    def exchange_state(self) -> None:
        """Every rank takes rank 0's state, which a synchronised rank already holds and a rank that joins does
        not: the optimizer's (its buffers tensor by tensor), the model's buffers, and the trainer's position.
        The parameters came from rank 0 when the optimizer was laid out."""
        self.opt.optimizer.broadcast_state()
        for buffer in self.model.buffers():
            dist.broadcast(buffer, src=0)
        position = [self._position() if self.is_main else None]
        dist.broadcast_object_list(position, src=0)
        if self.live.joining:
            self._take_position(position[0])
            self.live.joining = False

    def _settle_save(self) -> None:
        """A checkpoint still being written: finished or abandoned (its error logged), not a reason to stop (a lost
        rank breaks it)."""
        stop = self.stop_requested
        self.run_dir.settle_save()
        self.stop_requested = stop

    def _rejoin_world(self, broadcast: bool) -> None:
        """Lay the run out over the new default group: rank, world size, accumulation (the global batch kept), the
        data at the same position in the order that does not depend on the world size, the optimizer's state
        (DataParallelOptimizer.regroup), the logging; a rank that became rank 0 takes the run directory over."""
        was_main = self.is_main
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.is_main = self.rank == 0
        self.accum = check_batch_layout(self.recipe, self.world)
        position = self.batches.state_dict()
        self.task.close()
        self.task = build_task(self.recipe, self.rank, self.world)
        self.batches = DevicePrefetcher(self.task.loader, self.task.to_device, self.device)
        self.batches.load_state_dict(position)
        self.sync.forget_process_groups()
        with self._making_groups():
            self.opt.regroup(broadcast)
            # The checkpoint writer's group now, while every member is there: a save that made it later would wait in
            # its rendezvous for a rank lost meanwhile until train.timeout_s (a store wait no closed connection ends).
            self.run_dir.make_group(self.recipe.train.timeout_s)
        self.monitor = self._monitor()
        if self.is_main:
            log.warning("%d ranks: %s", self.world, self.sync.chosen)
        if self.is_main and not was_main:
            self.run_dir.lock()
            self.metrics = MetricsLogger(self.run_dir.path, self.recipe, self.recipe.train.steps, self.step, True)
