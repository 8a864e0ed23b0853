"""A real one-node Slurm cluster for the tests: munged, slurmctld and slurmd on this machine.

Everything lives in a private directory (its own munge key and socket, state, spool, logs, free
ports), so a Slurm already installed on the machine is neither used nor disturbed; clients find the
cluster through SLURM_CONF. Needs root (slurmd starts jobs as their user); Debian's slurm-wlm and
munge are installed with apt-get when missing.
"""

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")


def unavailable() -> str | None:
    """Why this machine cannot run the cluster (None: it can), installing Slurm first when root."""
    if os.geteuid() != 0:
        return "a one-node Slurm cluster needs root"
    if not all(shutil.which(d) or Path("/usr/sbin", d).exists() for d in DAEMONS):
        if shutil.which("apt-get") is None:
            return "slurm-wlm and munge are not installed and apt-get is missing"
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "slurm-wlm", "munge"]):
            done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
            if done.returncode != 0:
                return f"could not install slurm-wlm and munge: {done.stderr.strip()[-300:]}"
    return None


def _daemon(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _memory_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024 * 9 // 10
    return 1024


class SlurmCluster:
    """Start with start(), stop with stop() (idempotent; also after a failed start)."""

    def __init__(self):
        # mkdtemp, not pytest's tmp_path: munged runs as the munge user and must traverse the path.
        self.root = Path(tempfile.mkdtemp(prefix="zoa-slurm-"))
        self.root.chmod(0o755)
        self.node = socket.gethostname().split(".")[0]
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), capture_output=True, text=True, env=self.env, check=check, timeout=timeout)

    def start(self) -> None:
        munge = self.root / "munge"
        for sub in ("state", "spool", "log"):
            (self.root / sub).mkdir()
        munge.mkdir(mode=0o755)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        shutil.chown(munge, "munge", "munge")
        shutil.chown(key, "munge", "munge")
        self.socket = munge / "munge.sock"
        subprocess.run(
            [
                "runuser",
                "-u",
                "munge",
                "--",
                _daemon("munged"),
                f"--socket={self.socket}",
                f"--key-file={key}",
                f"--pid-file={munge / 'munged.pid'}",
                f"--log-file={munge / 'munged.log'}",
                f"--seed-file={munge / 'seed'}",
            ],
            check=True,
            capture_output=True,
            timeout=30,
        )
        r = self.root
        self.conf.write_text(f"""\
ClusterName=zoatest
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# cred_expire also sets how long a requeued job waits before it may start again (default 120 s)
AuthInfo=socket={self.socket},cred_expire=10
CredType=cred/munge
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
# No cgroups here (containers rarely allow them): processes are tracked by their parent links.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
KillWait=30
MinJobAge=3600
JobRequeue=1
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} RealMemory={_memory_mb()} State=UNKNOWN
PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
""")
        self.run(_daemon("slurmctld"), "-c", "-f", str(self.conf))
        self.run(_daemon("slurmd"), "-N", self.node, "-f", str(self.conf))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = self.node_state()
            if state == "idle":
                return
            time.sleep(0.5)
        raise RuntimeError(f"the Slurm node never became idle (state {state!r}); see {r}/log")

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as key -> value (JobState, Restarts, ExitCode, Reason, ...)."""
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(field.split("=", 1) for field in out.split() if "=" in field)

    def wait(self, job_id: str, timeout: float) -> dict[str, str]:
        """Wait until the job has ended."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job(job_id)
            state = info.get("JobState", "")
            if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
                return info
            time.sleep(1)
        raise TimeoutError(f"job {job_id} did not end within {timeout:.0f} s: {self.job(job_id)}")

    def node_state(self) -> str:
        return self.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.strip()

    def logs(self, lines: int = 40) -> str:
        """The tails of slurmctld's and slurmd's logs, for a failure message."""
        tails = []
        for name in ("slurmctld.log", "slurmd.log"):
            path = self.root / "log" / name
            text = path.read_text(errors="replace").splitlines()[-lines:] if path.is_file() else []
            tails.append(f"--- {name}\n" + "\n".join(text))
        return "\n".join(tails)

    def stop(self) -> None:
        self.run("scancel", "--full", "--user=root", check=False)
        self.run("scontrol", "shutdown", check=False)
        for pid_file in (self.root / "slurmd.pid", self.root / "slurmctld.pid", self.root / "munge" / "munged.pid"):
            try:
                pid = int(pid_file.read_text())
            except (OSError, ValueError):
                continue
            for _ in range(50):
                try:
                    os.kill(pid, 15)
                    if Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z"):
                        break  # exited; nobody reaps daemons in some containers
                except (ProcessLookupError, FileNotFoundError):
                    break
                time.sleep(0.1)
        shutil.rmtree(self.root, ignore_errors=True)
