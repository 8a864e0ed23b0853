"""Slurm batch jobs for `zoa-train run`: the sbatch script, its submission, and the run's job history.

`zoa-train slurm RECIPE --nodes N --gpus-per-node G` writes <run>/slurm/job.sbatch (readable, commented),
a snapshot of the resolved recipe (<run>/slurm/recipe.yaml, so editing the recipe while the job waits
changes nothing), and submits the script with `sbatch --parsable`. Each submission, start and requeue
is one line of <run>/slurm/jobs.jsonl.

Launchers:
  torchrun (default)  one Slurm task per node runs torchrun, which starts the node's ranks; c10d
                      rendezvous on the allocation's first node, rendezvous id = the job id. With
                      train.elastic reshard the job goes on when a node is lost (--no-kill; the agents,
                      --nnodes 1:N, restart the ranks at the new world size from the latest checkpoint).
  srun                one Slurm task per rank; each `zoa-train run` reads its rank from SLURM_PROCID,
                      SLURM_NTASKS and SLURM_LOCALID (zoa_train.distributed), the master from the node list.
  live                train.elastic live: one Slurm task per node runs `zoa-train run`, which starts the
                      node's ranks and restarts a failed one (--max-restarts); machine = SLURM_NODEID, the
                      store on the allocation's first node. The job and its step survive a lost node
                      (--no-kill, --kill-on-bad-exit=0): the other nodes go on (docs/faults.md, "Live").

Time limits and preemption: the script asks Slurm for a warning signal to the batch shell before the
time limit (`--signal=B:USR2@120` by default; USR2 because NCCL and torchrun leave it alone). The shell
forwards it to the job step (srun relays it to every task; torchrun is told to handle and forward it
too), every rank finishes its step, a complete checkpoint is written and the ranks exit 75. The shell
then requeues the job (`scontrol requeue`) at most --max-requeues times; a requeued job starts again
with `--resume auto` and continues exactly. A SIGTERM from Slurm itself (scancel, preemption with
GraceTime) reaches the ranks directly and also ends in a checkpoint; Slurm decides whether to requeue.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path

import yaml

from zoa_train.errors import UserError
from zoa_train.files import make_directory

SCRIPT = "job.sbatch"
LAUNCHERS = ("torchrun", "srun", "live")
RECIPE = "recipe.yaml"
HISTORY = "jobs.jsonl"
# The signals torchrun forwards to its ranks: its defaults plus the warning signal.
_TORCHRUN_SIGNALS = ["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"]
_SIGNAL = re.compile(r"^(?:SIG)?([A-Z0-9]+)@(\d+)$")
_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")  # Slurm's forms: MM, MM:SS, HH:MM:SS, D-HH[:MM[:SS]]


@dataclass
class SlurmJob:
    """What the sbatch script asks of Slurm, checked on construction."""

    nodes: int = 1
    gpus_per_node: int | None = None  # None: not given; 0: a CPU job
    nproc_per_node: int | None = None  # ranks per node [default: gpus_per_node]
    cpus_per_task: int | None = None
    partition: str = ""
    account: str = ""
    qos: str = ""
    time: str = ""
    constraint: str = ""
    job_name: str = ""
    env: dict[str, str] = field(default_factory=dict)
    launcher: str = "torchrun"
    signal: str = "USR2@120"
    max_requeues: int = 3
    max_restarts: int | None = None  # torchrun and live: how often a node's launcher starts failed ranks again [default: 3 if elastic, else 0]
    elastic: str = "off"  # the recipe's train.elastic: reshard and live keep the job going when a node is lost
    master_port: int = 0  # 0: derived from the job id inside the job
    sbatch_options: list[str] = field(default_factory=list)

    def __post_init__(self):
        if self.nodes < 1:
            raise UserError(f"--nodes must be at least 1, not {self.nodes}.")
        if self.launcher not in LAUNCHERS:
            raise UserError(f"--launcher must be torchrun, srun or live, not {self.launcher!r}.")
        if self.gpus_per_node is None and self.nproc_per_node is None:
            raise UserError("say how many ranks each node runs: --gpus-per-node G for a GPU job, or --nproc-per-node K for a CPU job.")
        if self.gpus_per_node is not None and self.gpus_per_node < 0:
            raise UserError(f"--gpus-per-node must be 0 or more, not {self.gpus_per_node}.")
        if self.nproc_per_node is not None and self.nproc_per_node < 1:
            raise UserError(f"--nproc-per-node must be at least 1, not {self.nproc_per_node}.")
        if self.gpus and self.nproc_per_node is not None and self.nproc_per_node > self.gpus:
            raise UserError(f"--nproc-per-node {self.nproc_per_node} is more ranks than the {self.gpus} GPUs per node; each rank needs a GPU of its own.")
        if self.cpus_per_task is not None and self.cpus_per_task < 1:
            raise UserError(f"--cpus-per-task must be at least 1, not {self.cpus_per_task}.")
        if self.time and not _TIME.match(self.time):
            raise UserError(f"--time {self.time!r} is not a Slurm time limit; use HH:MM:SS, MM or D-HH:MM:SS.")
        if not _SIGNAL.match(self.signal.upper()):
            raise UserError(f"--signal {self.signal!r} is not SIGNAL@SECONDS, e.g. USR2@120.")
        if self.max_requeues < 0:
            raise UserError(f"--max-requeues must be 0 or more, not {self.max_requeues}.")
        if self.max_restarts is not None and self.launcher == "srun":
            raise UserError(
                "--max-restarts starts failed ranks again inside the job, which torchrun and --launcher live do; srun starts each rank once, and the job requeues instead."
            )
        if self.max_restarts is not None and self.max_restarts < 0:
            raise UserError(f"--max-restarts must be 0 or more, not {self.max_restarts}.")
        if self.launcher == "live" and self.gpus:
            raise UserError("--launcher live runs CPU ranks over Gloo for now; pass --gpus-per-node 0 with --nproc-per-node.")
        if not 0 <= self.master_port < 65536:
            raise UserError(f"--master-port must be a TCP port (1-65535), not {self.master_port}.")
        for key in self.env:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                raise UserError(f"--env {key}=...: {key!r} is not an environment variable name.")

    @property
    def restarts(self) -> int:
        if self.max_restarts is not None:
            return self.max_restarts
        return 3 if self.elastic != "off" else 0

    @property
    def keeps_going(self) -> bool:
        """Whether the job goes on with the nodes it has when one is lost (train.elastic reshard or live)."""
        return self.elastic != "off" and self.launcher != "srun"

    @property
    def gpus(self) -> int:
        return self.gpus_per_node or 0

    @property
    def ranks_per_node(self) -> int:
        return self.nproc_per_node or self.gpus

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def warning(self) -> tuple[str, int]:
        """The warning signal's name (without SIG) and its lead time in seconds."""
        name, seconds = _SIGNAL.match(self.signal.upper()).groups()
        return name, int(seconds)


def parse_env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UserError(f"--env {pair!r} is not KEY=VALUE.")
        env[key] = value
    return env


def render_script(job: SlurmJob, run_dir: Path, workdir: Path, python: str = sys.executable) -> str:
    """The sbatch script for one recipe snapshot (<run>/slurm/recipe.yaml); paths are absolute."""
    run_dir, workdir = run_dir.resolve(), workdir.resolve()
    slurm_dir = run_dir / "slurm"
    signal_name, lead = job.warning
    q = shlex.quote
    name = job.job_name or f"zoa-{run_dir.name}"
    per_node = job.launcher != "srun"  # torchrun and live: one task per node starts the node's ranks
    cpus = job.cpus_per_task or (job.ranks_per_node if per_node else None)
    tasks = 1 if per_node else job.ranks_per_node
    sb = [
        f"#SBATCH --job-name={name}",
        f"#SBATCH --nodes={job.nodes}",
        f"# {job.launcher}: one task per node starts the node's ranks" if per_node else "# srun: one task per rank",
        f"#SBATCH --ntasks-per-node={tasks}",
    ]
    if job.keeps_going:
        sb += [f"# A lost node does not end the job: the other nodes go on (train.elastic {job.elastic}).", "#SBATCH --no-kill"]
    if job.gpus:
        sb.append(f"#SBATCH --gpus-per-node={job.gpus}")
    if cpus:
        sb.append(f"#SBATCH --cpus-per-task={cpus}")
    for option, value in (("partition", job.partition), ("account", job.account), ("qos", job.qos), ("time", job.time), ("constraint", job.constraint)):
        if value:
            sb.append(f"#SBATCH --{option}={value}")
    sb += [
        "# A requeued job appends to the same log.",
        f"#SBATCH --output={slurm_dir}/job-%j.out",
        "#SBATCH --open-mode=append",
        f"# Warn this script with {signal_name} {lead} s before the time limit; the job may requeue itself.",
        f"#SBATCH --signal=B:{signal_name}@{lead}",
        "#SBATCH --requeue",
        f"#SBATCH --chdir={workdir}",
        *(f"#SBATCH {option}" for option in job.sbatch_options),
    ]
    env = [f"export {key}={q(value)}" for key, value in sorted(job.env.items())]
    if job.keeps_going and job.launcher == "torchrun":  # each attempt's ranks meet in a store of their own (docs/faults.md)
        env.append("export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")
    port = str(job.master_port) if job.master_port else "$((20000 + SLURM_JOB_ID % 20000))"
    train = [q(python), "-m", "zoa_train.cli", "run", q(str(slurm_dir / RECIPE)), "--out", q(str(run_dir)), "--resume", "auto"]
    kill = "--no-kill --kill-on-bad-exit=0" if job.keeps_going else "--kill-on-bad-exit=1"
    if job.launcher == "torchrun":
        handled = ",".join(dict.fromkeys(_TORCHRUN_SIGNALS + [f"SIG{signal_name}"]))
        # train.elastic reshard: the agents go on with 1 to all nodes, each change a restart at the new world size
        nnodes = '1:"$SLURM_NNODES"' if job.keeps_going else '"$SLURM_NNODES"'
        restarts = f" --max-restarts={job.restarts}" if job.restarts else ""
        launch = [
            f"srun --ntasks-per-node=1 {kill} {q(python)} -m torch.distributed.run \\",
            f"    --nnodes={nnodes} --nproc-per-node={job.ranks_per_node}{restarts} \\",
            '    --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID" \\',
            *(["    --rdzv-conf=last_call_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=5 \\"] if job.keeps_going else []),
            f"    --signals-to-handle={handled} --shutdown-timeout={lead} \\",
            "    " + " ".join(train[1:]) + " &",
        ]
    elif job.launcher == "live":
        # each node's zoa-train run takes its machine (SLURM_NODEID) and the store (MASTER_ADDR:MASTER_PORT) from Slurm
        launch = [
            f"srun --ntasks-per-node=1 {kill} \\",
            "    " + " ".join(train) + f" --nproc {job.ranks_per_node} --max-restarts {job.restarts} &",
        ]
    else:
        launch = [f"srun --ntasks-per-node={job.ranks_per_node} --kill-on-bad-exit=1 \\", "    " + " ".join(train) + " &"]
    history = q(str(slurm_dir / HISTORY))
    lines = [
        "#!/bin/bash",
        f"# zoa-train: {job.world_size} ranks ({job.nodes} node(s) x {job.ranks_per_node}, {'GPU/NCCL' if job.gpus else 'CPU/Gloo'}), "
        f"launcher {job.launcher}; written by `zoa-train slurm`.",
        f"# Run directory {run_dir}; the recipe is the snapshot beside this script.",
        f"# Resubmit as it is with: sbatch {slurm_dir / SCRIPT}",
        *sb,
        "",
        "set -uo pipefail",
        *env,
        'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"export MASTER_PORT={port}",
        f"MAX_REQUEUES={job.max_requeues}",
        f"HISTORY={history}",
        "RESTART=${SLURM_RESTART_COUNT:-0}",
        "",
        "record() {  # one line of the run's job history: event [exit status]",
        '    printf \'{"event": "%s", "job_id": "%s", "restart": %s, "nodes": "%s", "time": "%s", "status": %s}\\n\' \\',
        '        "$1" "$SLURM_JOB_ID" "$RESTART" "$SLURM_JOB_NODELIST" "$(date -Is)" "${2:-null}" >> "$HISTORY"',
        "}",
        'echo "zoa-train: job $SLURM_JOB_ID (restart $RESTART) on $SLURM_JOB_NODELIST, master $MASTER_ADDR:$MASTER_PORT"',
        "record start",
        "",
        f"# The warning signal: ask every rank to finish its step and checkpoint (srun relays {signal_name} to",
        "# the tasks), then requeue below. --resume auto makes a fresh directory start at step 0 and a",
        "# requeued job continue from its latest complete checkpoint.",
        "warned=0 step=",
        f'on_warning() {{ warned=1; echo "zoa-train: {signal_name}: checkpointing before the time limit"; kill -{signal_name} "$step" 2>/dev/null; }}',
        f"trap on_warning {signal_name}",
        "",
        *launch,
        "step=$!",
        "while :; do  # `wait` returns early when the trap runs; wait again until the step has ended",
        '    wait "$step"; status=$?',
        '    kill -0 "$step" 2>/dev/null || break',
        "done",
        "",
        "if [[ $warned == 1 && $status != 0 ]]; then",
        "    if (( RESTART < MAX_REQUEUES )); then",
        '        echo "zoa-train: requeueing job $SLURM_JOB_ID (requeue $((RESTART + 1)) of $MAX_REQUEUES)"',
        "        record requeue",
        '        scontrol requeue "$SLURM_JOB_ID"',
        "        exit 0",
        "    fi",
        f'    echo "zoa-train: stopped after $MAX_REQUEUES requeues; continue with: sbatch {slurm_dir / SCRIPT}"',
        "fi",
        'record end "$status"',
        'exit "$status"',
        "",
    ]
    return "\n".join(lines)


def _squeue_state(job_id: str) -> str:
    """The job's state while Slurm still lists it as pending or running, else ''."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def queued_jobs(run_dir: Path) -> list[tuple[str, str]]:
    """(job id, state) of this run directory's submissions that are still pending or running."""
    history = run_dir / "slurm" / HISTORY
    if not history.is_file():
        return []
    ids = []
    for line in history.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("event") == "submitted" and record.get("job_id") not in ids:
            ids.append(record["job_id"])
    return [(i, state) for i in ids if (state := _squeue_state(i)) and state not in ("COMPLETED", "FAILED", "CANCELLED")]


def submit(script: Path) -> str:
    """`sbatch --parsable SCRIPT`; the job id, or a UserError with sbatch's own message."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise UserError("sbatch is not on PATH (is this a Slurm login node?); pass --dry-run to only print the script.")
    try:
        done = subprocess.run([sbatch, "--parsable", str(script)], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        raise UserError("sbatch did not answer within 120 s; is slurmctld reachable?") from None
    if done.returncode != 0:
        message = " ".join(done.stderr.split()) or f"exit code {done.returncode}"
        raise UserError(f"sbatch refused the job: {message}")
    return done.stdout.strip().split(";")[0]  # "id" or "id;cluster"


def write_job(job: SlurmJob, recipe: dict, run_dir: Path, workdir: Path) -> Path:
    """Write the recipe snapshot and the script under <run>/slurm/; returns the script's path."""
    from zoa_train.data.cache import atomic_write_text

    slurm_dir = run_dir / "slurm"
    make_directory(slurm_dir, "run directory")
    atomic_write_text(slurm_dir / RECIPE, yaml.safe_dump(recipe, sort_keys=False))
    script = slurm_dir / SCRIPT
    atomic_write_text(script, render_script(job, run_dir, workdir))
    script.chmod(0o755)
    return script


def record_submission(run_dir: Path, job_id: str, script: Path, job: SlurmJob) -> None:
    entry = {
        "event": "submitted",
        "job_id": job_id,
        "time": datetime.now().astimezone().isoformat(timespec="seconds"),
        "script": str(script),
        "world_size": job.world_size,
        "launcher": job.launcher,
        "submitted_from": os.getcwd(),
    }
    with open(run_dir / "slurm" / HISTORY, "a") as f:
        f.write(json.dumps(entry) + "\n")


def submit_recipe(job: SlurmJob, recipe: Path, overrides: list[str], run_dir: Path, resume: str, overwrite: bool, dry_run: bool) -> None:
    """`zoa-train slurm`: write the job for `recipe` into `run_dir` and submit it (`dry_run`: print the
    script alone); UserError of one sentence for a job that cannot run."""
    from zoa_train.config import check_batch_layout, load_recipe
    from zoa_train.console import out
    from zoa_train.train.rundir import RunDirectory

    config = load_recipe(recipe, overrides)
    if job.launcher == "live" and config.train.elastic != "live":
        raise UserError(f"--launcher live starts a train.elastic live run and {recipe} sets train.elastic {config.train.elastic}; set train.elastic=live.")
    if job.launcher != "live" and config.train.elastic == "live":
        raise UserError(f"{recipe} sets train.elastic live, whose ranks each node's zoa-train run starts itself; submit it with --launcher live.")
    job = replace(job, elastic=config.train.elastic)
    if not job.gpus:
        if config.train.backend == "nccl":
            raise UserError(f"{recipe} sets train.backend nccl and this is a CPU job; give it GPUs with --gpus-per-node or set train.backend=gloo.")
        config.train.backend = "gloo"
    check_batch_layout(config, job.world_size, str(recipe))
    if dry_run:
        out.print(render_script(job, run_dir, Path.cwd()), highlight=False, markup=False, soft_wrap=True)
        return
    if resume not in ("", "auto"):
        raise UserError(f"--resume {resume}: a Slurm job continues its run directory's latest checkpoint; pass --resume auto.")
    queued = queued_jobs(run_dir)
    if queued:
        raise UserError(f"job {queued[0][0]} ({queued[0][1].lower()}) already uses run directory {run_dir}; wait for it or scancel it first.")
    rundir = RunDirectory(run_dir)
    rundir.check(resume or None, overwrite, job.world_size)
    if overwrite:  # empty it now, under its lock: the job itself always starts with --resume auto
        rundir.prepare(None, True, job.world_size, 0)
        rundir.close()
    fresh = [p for p in (run_dir, run_dir / "slurm") if not p.exists()]
    script = write_job(job, config.to_dict(), run_dir, Path.cwd())
    try:
        job_id = submit(script)
    except UserError:
        if fresh:  # a refused job leaves no trace, so the same command can be run again
            shutil.rmtree(fresh[0])
        raise
    record_submission(run_dir, job_id, script, job)
    log = script.parent / f"job-{job_id}.out"
    out.print(f"submitted job {job_id}: {job.world_size} ranks on {job.nodes} node(s), launcher {job.launcher}", highlight=False)
    out.print(f"  script   {script}\n  log      {log}\n  history  {script.parent / 'jobs.jsonl'}", highlight=False)
    out.print(f"  follow   squeue -j {job_id}; sacct -j {job_id} --format=JobID,State,Elapsed,ExitCode; tail -f {log}", highlight=False, soft_wrap=True)
