"""A throwaway Slurm cluster on this machine, for testing batch scripts against the real thing.

munged, slurmctld and N slurmd daemons (`slurmd -N nodeK`, each on its own port, all on 127.0.0.1) run from
a private folder: config, state, spool, sockets and logs live there and nowhere else. `stop()` cancels the
jobs, ends the daemons by their PIDs, then ends any process still carrying this cluster's SLURM_CONF in its
environment (job steps outlive slurmd), so nothing is left running.

    with SlurmCluster(tmp_dir, nodes=2) as cluster:
        job = cluster.sbatch("scripts/slurm/train.sbatch", "recipes/debug.toml", options=["--nodes=2"])
        info = cluster.wait(job, timeout=300)

Needs root (slurmd launches jobs as the submitting user) and Debian's `slurm-wlm` and `munge`; `unavailable()`
says why a cluster cannot run here, and `SlurmCluster.start` raises `ClusterUnavailable` if the daemons do not
come up.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from distributed import free_port

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel", "sinfo")
PACKAGES = ("slurm-wlm", "munge")
FINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}


class ClusterUnavailable(RuntimeError):
    """The cluster cannot run on this machine; the message says why."""


def unavailable(install: bool = True) -> str | None:
    """Why a local cluster cannot run here, or None. As root with apt, missing packages are installed first."""
    if os.geteuid() != 0:
        return "a local Slurm cluster needs root (slurmd starts job steps as the submitting user)"
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing and install and shutil.which("apt-get"):
        _apt_install()
        missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        packages = " ".join(PACKAGES)
        return (
            f"{', '.join(missing)} not found: install Debian's {' and '.join(PACKAGES)} (apt-get install -y {packages})"
        )
    return None


def _apt_install(timeout: float = 300) -> None:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    try:
        if subprocess.run(install, env=env, capture_output=True, timeout=timeout).returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=timeout)
            subprocess.run(install, env=env, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pass


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1, below the ephemeral range (distributed.free_port says why)."""
    ports: set[int] = set()
    while len(ports) < n:
        ports.add(free_port())
    return sorted(ports)


class SlurmCluster:
    def __init__(self, root: Path, nodes: int = 2, cpus_per_node: int = 1):
        self.root = Path(root)
        self.nodes = [f"node{i + 1}" for i in range(nodes)]
        self.cpus_per_node = cpus_per_node
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self._daemons: dict[str, subprocess.Popen] = {}

    # -----------------------------------------------------------------------------------------
    # Lifecycle

    def __enter__(self) -> SlurmCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def env(self) -> dict[str, str]:
        """The environment for client commands (sbatch, squeue, ...) and for the daemons themselves."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self, timeout: float = 30) -> None:
        reason = unavailable()
        if reason:
            raise ClusterUnavailable(reason)
        # munged insists that every folder above its socket is searchable by all, and the key private.
        self.root.mkdir(parents=True, exist_ok=True)
        for folder in (self.root, self.munge_socket.parent):
            folder.mkdir(exist_ok=True)
            folder.chmod(0o755)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        for folder in ("state", "spool"):
            (self.root / folder).mkdir(exist_ok=True)
        (self.root / "plugstack.conf").write_text("")
        self._write_conf(free_ports(1 + len(self.nodes)))

        munge_dir = self.munge_socket.parent
        self._spawn(
            "munged",
            [
                "munged",
                "--foreground",
                f"--socket={self.munge_socket}",
                f"--key-file={key}",
                f"--pid-file={munge_dir / 'munged.pid'}",
                f"--seed-file={munge_dir / 'munged.seed'}",
            ],
        )
        self._until(lambda: self.munge_socket.exists(), timeout, "munged did not create its socket")
        self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        for node in self.nodes:
            self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-N", node, "-f", str(self.conf)])
        self._until(self._all_idle, timeout, "the nodes did not become idle")

    def _write_conf(self, ports: list[int]) -> None:
        host = socket.gethostname().split(".")[0]
        r = self.root
        lines = [
            "ClusterName=titantest",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ports[0]}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire also delays a requeued job's restart (default 120 s).
            f"AuthInfo=socket={self.munge_socket},cred_expire=5",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool' / '%n'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd-%n.pid'}",
            f"PlugStackConfig={r / 'plugstack.conf'}",
            # No cgroups in a container: track processes by parentage, bind nothing.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin",
            "SchedulerParameters=sched_interval=1",  # start a requeued job as soon as it may start
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "ReturnToService=2",
            "SlurmdTimeout=10",  # a lost node's jobs complete once it is marked down
            "SlurmdParameters=config_overrides",  # trust the CPUs below, not the hardware
            "MinJobAge=3600",  # keep finished jobs visible to scontrol (there is no accounting database)
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
        ]
        for node, port in zip(self.nodes, ports[1:]):
            lines.append(
                f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={self.cpus_per_node} "
                "State=UNKNOWN"
            )
        lines.append(f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    def _spawn(self, name: str, command: list[str]) -> None:
        with open(self.root / f"{name}.log", "wb") as log:
            self._daemons[name] = subprocess.Popen(
                command, env=self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.root
            )

    def _until(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [name for name, p in self._daemons.items() if p.poll() is not None]
            if dead:
                raise ClusterUnavailable(f"{dead[0]} exited: {self.log_tail(dead[0])}")
            if ready():
                return
            time.sleep(0.2)
        raise ClusterUnavailable(f"{what} within {timeout:.0f} s; {self.log_tail('slurmctld')}")

    def _all_idle(self) -> bool:
        result = self._run(["sinfo", "--noheader", "--Node", "--format=%N %T"], check=False)
        states = dict(line.split() for line in result.stdout.splitlines() if line.strip())
        return all(states.get(node) == "idle" for node in self.nodes)

    def log_tail(self, name: str, lines: int = 15) -> str:
        path = self.root / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return " | ".join(text.strip().splitlines()[-lines:])

    def stop(self, timeout: float = 15) -> None:
        """Cancel every job, end the daemons by PID, then any process of this cluster's jobs still running."""
        if self._daemons.get("slurmctld") and self._daemons["slurmctld"].poll() is None:
            jobs = self._run(["squeue", "--noheader", "--format=%i"], check=False).stdout.split()
            if jobs:
                self._run(["scancel", *jobs], check=False)
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline and self._run(["squeue", "--noheader"], check=False).stdout.strip():
                    time.sleep(0.3)
        for process in reversed(list(self._daemons.values())):  # slurmd, then slurmctld, then munged
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(timeout)
        self._daemons.clear()
        for pid in self._leftover_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _leftover_pids(self) -> list[int]:
        """Processes whose environment names this cluster's slurm.conf: job scripts, steps, their children."""
        marker = f"SLURM_CONF={self.conf}".encode()
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:
                continue
        return pids

    def lose_node(self, node: str) -> None:
        """The node's loss as its jobs see it: its slurmd and every process of its job steps (SLURMD_NODENAME)
        killed at once, and the node marked down, as slurmctld marks it once SlurmdTimeout passes: at once here, so
        that its jobs meet the node failure while they still run, whatever the machine's speed."""
        self._daemons.pop(f"slurmd-{node}").kill()
        marker = f"SLURMD_NODENAME={node}".encode()
        for pid in self._leftover_pids():
            try:
                if marker in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    os.kill(pid, signal.SIGKILL)
            except OSError:
                continue
        self._run(["scontrol", "update", f"NodeName={node}", "State=DOWN", "Reason=lost"])

    # -----------------------------------------------------------------------------------------
    # Jobs

    def _run(
        self, command: list[str], check: bool = True, timeout: float = 30, **kwargs
    ) -> subprocess.CompletedProcess:
        result = subprocess.run(
            command, env=kwargs.pop("env", self.env), capture_output=True, text=True, timeout=timeout, **kwargs
        )
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}): {result.stderr.strip()}")
        return result

    def sbatch(self, script: str | Path, *args: str, options: list[str] = (), env: dict | None = None, cwd=None) -> int:
        """Submit a batch script (with sbatch options and script arguments); returns the job id."""
        result = self._run(
            ["sbatch", "--parsable", *options, str(script), *args], env={**self.env, **(env or {})}, cwd=cwd
        )
        return int(result.stdout.strip().split(";")[0])

    def scancel(self, job_id: int, *options: str) -> None:
        self._run(["scancel", *options, str(job_id)])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict: JobState, ExitCode, Restarts, NodeList, StdOut, ..."""
        out = self._run(["scontrol", "show", "job", "--oneliner", str(job_id)]).stdout
        return dict(field.split("=", 1) for field in out.split() if "=" in field)

    def wait(self, job_id: int, timeout: float, until=None) -> dict[str, str]:
        """Poll until the job is in a final state (or `until(info)` holds); raises TimeoutError past timeout."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if until(info) if until else info.get("JobState") in FINAL_STATES:
                return info
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {info.get('JobState')} after {timeout:.0f} s")
            time.sleep(0.5)
