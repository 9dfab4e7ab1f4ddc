"""Snapshots in host shared memory belong to one user, one run and one torchrun agent: other users' folders are
refused, agents on one host keep theirs apart, a full shared memory turns snapshots off instead of ending the run,
and whatever ends a run gives its shared memory back."""

import errno
import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from agents import RUN, last_losses, logged_steps, process_tree, wait_for_step
from conftest import DEBUG_RECIPE, ROOT, run_titan, scenarios_beyond, tiny_overrides
from distributed import free_port
from helpers import trainer_for
from titan.checkpoint import checkpointer
from titan.checkpoint.snapshots.folder import OWNER, snapshot_folder
from titan.config import load_config
from titan.errors import ConfigError
from titan.train.step import StepHook
from titan.train.stop import NonFinite, Preempted
from titan.train.trainer import Trainer

SNAPSHOTS = {**RUN, "training.steps": "6", "checkpoint.interval": "1000", "fault.snapshot_interval": "1"}


@pytest.fixture
def shm(tmp_path, monkeypatch):
    """This host's shared memory (sticky and world-writable, as /dev/shm), under torchrun with restarts allowed."""
    memory = tmp_path / "shm"
    memory.mkdir()
    memory.chmod(0o1777)
    monkeypatch.setenv("TITAN_SNAPSHOT_DIR", str(memory))
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    return memory


class NaNFrom(StepHook):
    """Every loss from step `step` on is NaN."""

    def __init__(self, first: int):
        self.first = first

    def loss(self, step, loss):
        return loss * float("nan") if step + 1 >= self.first else loss


def snapshot_steps(run_dir) -> list[int]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in records if "snapshot_blocked_s" in r]


@pytest.mark.parametrize("made", ["open to others", "another user's", "a link"])
def test_a_snapshot_folder_titan_did_not_make_is_refused_and_nothing_is_restored(tmp_path, shm, monkeypatch, made):
    """A restart whose snapshot folder somebody else made first (to plant the state it resumes from) refuses it in
    one line, before reading any of it."""
    if made == "another user's" and os.getuid() != 0:
        pytest.skip("giving a folder to another user takes root")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    folder = snapshot_folder(tmp_path / "run" / "debug")
    if made == "a link":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        folder.symlink_to(tmp_path / "elsewhere")
    else:
        folder.mkdir()
        folder.chmod(0o777 if made == "open to others" else 0o700)
        (folder / "snap-40" / "rank-0").mkdir(parents=True)
        if made == "another user's":
            os.chown(folder, 4321, 4321)
    words = {
        "open to others": "has mode 777, open to other users",
        "another user's": r"belongs to uid 4321, not to this user \(uid \d+\)",
        "a link": "is a symbolic link",
    }[made]
    with pytest.raises(ConfigError, match=f"the snapshot folder {folder} {words}: titan did not make it"):
        trainer_for(tmp_path / "run", **SNAPSHOTS)


OTHER_USER = "titan-other"  # a second local user, made by the test


@pytest.fixture
def other_user(tmp_path, monkeypatch):
    """A second local user, and a shared memory that user can reach (pytest's folders are 0700): a folder of the
    real /dev/shm, sticky and world-writable as /dev/shm itself."""
    if os.getuid() != 0 or shutil.which("useradd") is None or shutil.which("runuser") is None:
        pytest.skip("a second local user takes root, useradd and runuser")
    if subprocess.run(["id", "-u", OTHER_USER], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", OTHER_USER], check=True)
    memory = Path(tempfile.mkdtemp(prefix="titan-test-shm-", dir="/dev/shm"))
    memory.chmod(0o1777)
    monkeypatch.setenv("TITAN_SNAPSHOT_DIR", str(memory))
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    yield memory
    shutil.rmtree(memory, ignore_errors=True)


def as_other_user(code: str) -> subprocess.CompletedProcess:
    """Python `code` run as the second user (the system's interpreter: it needs no titan)."""
    return subprocess.run(["runuser", "-u", OTHER_USER, "--", "python3", "-c", code], capture_output=True, text=True,
                          timeout=60)  # fmt: skip


@pytest.mark.scenario
def test_a_second_local_user_can_read_nothing_and_plant_nothing(tmp_path, other_user, monkeypatch):
    """As another local user: everything the run writes in shared memory is closed to them (listing, reading,
    adding a file), and a folder they make where the run's next start would snapshot is refused in one line."""
    trainer = trainer_for(tmp_path / "run", **SNAPSHOTS)
    trainer.train(until=3)
    folder = trainer.recovery.snapshots.folder
    written = [str(p) for p in folder.rglob("*")]
    assert any(p.endswith(".distcp") for p in written), written
    tries = f"""
import os
for path in [{str(folder)!r}, *{written!r}]:
    for attempt in (os.listdir if os.path.isdir(path) else lambda p: open(p, "rb").read(1),
                    lambda p: open(os.path.join(p, "planted"), "w") if os.path.isdir(p) else open(p, "ab")):
        try:
            attempt(path)
            print("allowed", path)
        except PermissionError:
            pass
"""
    result = as_other_user(tries)
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a restart: it would restore what the folder holds
    planted = snapshot_folder(tmp_path / "planted" / "debug")
    made = as_other_user(f"import os; os.makedirs({str(planted / 'snap-40' / 'rank-0')!r}); "
                         f"os.chmod({str(planted)!r}, 0o777)")  # fmt: skip
    assert made.returncode == 0, made.stderr
    uid = int(subprocess.run(["id", "-u", OTHER_USER], capture_output=True, text=True).stdout)
    with pytest.raises(ConfigError, match=f"the snapshot folder {planted} belongs to uid {uid}, not to this user"):
        trainer_for(tmp_path / "planted", **SNAPSHOTS)


def test_the_folder_is_the_users_alone_and_is_freed_at_the_end(tmp_path, shm):
    trainer = trainer_for(tmp_path / "run", **SNAPSHOTS)
    trainer.train(until=3)
    (folder,) = shm.iterdir()
    assert folder.name.startswith(f"titan-snapshots-{os.getuid()}-") and folder == trainer.recovery.snapshots.folder
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and folder.stat().st_uid == os.getuid()
    owner = json.loads((folder / OWNER).read_text())
    assert owner["pid"] == os.getppid() and owner["run"].startswith(str(trainer.run_dir))
    trainer.train()
    assert not list(shm.iterdir())


def test_a_run_that_stops_frees_its_snapshots_and_a_later_start_removes_those_a_dead_agent_left(tmp_path, shm):
    """A NaN stop ends the run: its snapshots go. A folder whose agent no longer runs (a kill -9 left it) is removed
    by the next start on the host, with one line."""
    stopped = trainer_for(tmp_path / "nan", NaNFrom(4), **SNAPSHOTS)
    with pytest.raises(NonFinite):
        stopped.train()
    assert not list(shm.iterdir())

    left = shm / f"titan-snapshots-{os.getuid()}-0123456789abcdef"
    shutil.copytree(trainer_for(tmp_path / "kept", **SNAPSHOTS).recovery.snapshots.folder, left)
    owner = json.loads((left / OWNER).read_text())
    (left / OWNER).write_text(json.dumps({**owner, "pid": 2**22 + 1}))  # no such process
    left.chmod(0o700)
    trainer_for(tmp_path / "next", **SNAPSHOTS)
    assert not left.exists()


class AtStep(StepHook):
    """At step `at` (before it runs): send this process `signal`, or fail as a broken step does."""

    def __init__(self, at: int, signal: int | None = None):
        self.at, self.signal = at, signal

    def step(self, step, batches, run):
        if step + 1 == self.at:
            if self.signal is None:
                raise RuntimeError("a step that failed")
            os.kill(os.getpid(), self.signal)
        return run(batches)


@pytest.mark.parametrize(
    "end, restart, freed",
    [("SIGTERM", 0, True), ("a failure", 0, False), ("a failure", 3, True)],
    ids=["sigterm", "failure-with-restarts-left", "failure-with-no-restart-left"],
)
def test_a_run_that_ends_gives_its_shared_memory_back_and_one_torchrun_restarts_keeps_it_closed(
    tmp_path, shm, monkeypatch, end, restart, freed
):
    """SIGTERM (a preemption: checkpoint, then stop) ends the run, and so does a failure once torchrun has no restart
    left (--max-restarts 3, the third restart failing): the snapshots go. A failure torchrun restarts the workers
    after keeps them for the restart, in a folder and files no other user can open."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(restart))
    trainer = trainer_for(tmp_path / "run", AtStep(4, signal.SIGTERM if end == "SIGTERM" else None), **SNAPSHOTS)
    with pytest.raises(Preempted if end == "SIGTERM" else RuntimeError):
        trainer.train()
    left = list(shm.iterdir())
    assert left == ([] if freed else [trainer.recovery.snapshots.folder]), left
    for path in [*left, *(p for folder in left for p in folder.rglob("*"))]:
        assert stat.S_IMODE(path.lstat().st_mode) & 0o077 == 0, f"{path} is open to others"


@pytest.mark.parametrize("fault", ["full", "write fails"])
def test_shared_memory_that_fills_turns_snapshots_off_and_training_goes_on(tmp_path, shm, monkeypatch, capsys, fault):
    """Snapshots only save steps: once step 3's is held, the shared memory has no room for another (or the next
    one's write fails: no space left on device). The run trains on to its end without snapshots, saying so once."""
    if fault == "full":
        usage = shutil.disk_usage
        monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(path)._replace(free=0) if full() else usage(path))
    else:
        write = checkpointer.write_train_state

        def failing(folder, **state):
            if full() and str(folder).startswith(str(shm)):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder))
            write(folder, **state)

        monkeypatch.setattr(checkpointer, "write_train_state", failing)
    full = lambda: any(shm.glob("titan-snapshots-*/snap-3"))  # noqa: E731
    trainer = trainer_for(tmp_path / "run", **SNAPSHOTS)
    trainer.train()
    assert trainer.step == 6 and snapshot_steps(trainer.run_dir) == [1, 2, 3]
    off = [line for line in capsys.readouterr().err.splitlines() if "snapshots off" in line]
    why = "a snapshot needs" if fault == "full" else "its snapshot could not be written (cannot write"
    assert len(off) == 1 and "snapshots off from step 4: " + why in off[0], off
    assert fault == "full" or "no space left on device" in off[0], off
    assert "training goes on without them" in off[0]
    assert not list(shm.iterdir())


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("nodes", scenarios_beyond([2], [2, 3]))
def test_agents_on_one_host_keep_their_snapshots_apart(tmp_path, shm, nodes):
    """Two (three) nodes on one host, each started as the docs say (`titan launch --nnodes N:N --rdzv HOST:PORT train
    ...`) with the default snapshots ("auto") and one shared memory: each agent's folder its own (one folder for all
    crashed a run with no failure at its first snapshot). The run never restarts, trains one process's losses, and
    leaves nothing in shared memory."""
    steps = 8
    run = {**RUN, "training.steps": str(steps), "checkpoint.interval": "1000", "training.global_batch_size": "12"}
    train = ["train", "--config", str(DEBUG_RECIPE), *tiny_overrides(tmp_path / "run", **run)]
    rdzv = f"127.0.0.1:{free_port()}"
    launch = [sys.executable, "-m", "titan", "launch", "--nnodes", f"{nodes}:{nodes}", "--rdzv", rdzv]
    logs = [tmp_path / f"node{n}.log" for n in range(nodes)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = [subprocess.Popen([*launch, *train], cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
              for log in logs]  # fmt: skip
    owners = {}
    try:
        deadline = time.monotonic() + 300
        while any(agent.poll() is None for agent in agents) and time.monotonic() < deadline:
            for owner in shm.glob(f"titan-snapshots-*/{OWNER}"):
                try:
                    owners[owner.parent.name] = json.loads(owner.read_text())["pid"]
                except (OSError, ValueError):
                    pass  # freed or being written
            time.sleep(0.05)
        codes = [agent.wait(timeout=10) for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
            agent.wait()
    assert codes == [0] * nodes, "".join(log.read_text()[-3000:] for log in logs)
    for log in logs:  # the torchrun line, first
        assert log.read_text().startswith(
            f"titan launch: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes {nodes}:"
        )
    assert sorted(owners.values()) == sorted(agent.pid for agent in agents), owners  # the workers' parents
    assert not list(shm.iterdir())
    metrics = tmp_path / "run" / "debug" / "metrics.jsonl"
    assert "elastic_restart" not in metrics.read_text() and "snapshot_blocked_s" in metrics.read_text()
    reference = Trainer(load_config(DEBUG_RECIPE, tiny_overrides(tmp_path / "reference", **run)))
    reference.train()
    expected = last_losses(logged_steps(reference.run_dir / "metrics.jsonl"))
    got = last_losses(logged_steps(metrics))
    assert sorted(got) == list(range(1, steps + 1))
    for step in got:
        assert got[step]["tokens_seen"] == expected[step]["tokens_seen"], step
        assert got[step]["loss"] == pytest.approx(expected[step]["loss"], rel=1e-5), step


def as_a_worker_of_a_new_agent(args: list[str], log: Path, **env) -> subprocess.Popen:
    """`titan train ARGS` as a worker of an agent of its own (sh stands for torchrun: the worker's parent), its
    stderr in `log`."""
    line = shlex.join([sys.executable, "-m", "titan", "train", "--config", str(DEBUG_RECIPE), *args])
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    return subprocess.Popen(["sh", "-c", f"{line}; exit $?"], cwd=ROOT, env=env, stderr=log.open("w"))


def killed_whole_at(agent: subprocess.Popen, metrics: Path, step: int) -> None:
    """kill -9 of the agent and its worker once `step` is logged."""
    try:
        wait_for_step(metrics, step, [agent])
    finally:
        for pid in reversed(process_tree(agent.pid)):
            os.kill(pid, signal.SIGKILL)
        agent.wait()


@pytest.mark.slow
def test_what_kill_9_of_every_process_leaves_is_listed_and_cleaned(tmp_path, shm):
    """An agent and its worker killed with SIGKILL free nothing: `titan snapshots ls` shows the folder as its gone
    agent's, with the steps it holds; `titan snapshots clean --gone` removes it."""
    args = tiny_overrides(tmp_path / "run", **{**SNAPSHOTS, "training.steps": "1000"})
    agent = as_a_worker_of_a_new_agent(args, tmp_path / "killed.log")
    killed_whole_at(agent, tmp_path / "run" / "debug" / "metrics.jsonl", 3)
    listed = run_titan("snapshots", "ls")
    (line, total) = listed.stdout.splitlines()
    assert line.startswith(f"titan-snapshots-{os.getuid()}-") and f"run {tmp_path / 'run' / 'debug'}," in line, line
    assert f"agent {agent.pid} on " in line and line.endswith(", gone") and ", steps " in line, line
    assert total.startswith(f"1 in {shm}, ")
    cleaned = run_titan("snapshots", "clean", "--gone")
    assert cleaned.returncode == 0 and cleaned.stdout.startswith("removed titan-snapshots-"), cleaned.stdout
    assert not list(shm.iterdir())
    assert run_titan("snapshots", "ls").stdout == f"0 in {shm}, 0 MiB\n"


@pytest.mark.slow
def test_a_relaunch_restores_its_own_disk_checkpoint_not_an_abandoned_jobs_snapshot(tmp_path, shm):
    """A job snapshots every step, saves to disk at step 3, and is killed whole at step 5. The relaunch's first
    attempt dies before titan starts, so its workers see restart count 1: they restore the disk's step 3, not the
    abandoned job's newer snapshot (another agent's), and the next start removes that folder."""
    args = tiny_overrides(tmp_path / "run", **{**SNAPSHOTS, "training.steps": "1000", "checkpoint.interval": "3"})
    killed_whole_at(
        as_a_worker_of_a_new_agent(args, tmp_path / "first.log"), tmp_path / "run" / "debug" / "metrics.jsonl", 5
    )
    (abandoned,) = shm.iterdir()
    assert max(int(p.name[5:]) for p in abandoned.glob("snap-*")) >= 4
    shorter = ["--training.steps", "6", "--checkpoint.allow_changes", "training.steps"]  # to finish soon
    relaunch = as_a_worker_of_a_new_agent([*args, *shorter], tmp_path / "relaunch.log", TORCHELASTIC_RESTART_COUNT="1")
    relaunch.wait(timeout=300)
    err = (tmp_path / "relaunch.log").read_text()
    assert relaunch.returncode == 0, err[-3000:]
    assert "restoring the in-memory snapshot" not in err and "continuing at step 3" in err, err[-3000:]
    assert "snapshots: removed 1 folder of runs no longer running" in err and not abandoned.exists()


def mount_namespaces_work() -> bool:
    if os.getuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode == 0


@pytest.mark.scenario
@pytest.mark.distributed
def test_two_jobs_at_one_path_in_two_mount_namespaces_keep_their_snapshots_apart(tmp_path, shm):
    """Two containers sharing the host's /dev/shm (`--ipc=host`), each with its run folder at the same path and the
    same rendezvous id, as two mount namespaces of one host: two single-node elastic jobs of other seeds snapshot
    every step; job A's worker is killed at step 4 and its agent restarts it. Each job snapshots into a folder of its
    own and trains its own one-process losses to the end (A from its own snapshot), and shared memory is empty
    afterwards. (Whichever job runs first: one may finish before the other has snapshotted once.)"""
    if not mount_namespaces_work():
        pytest.skip("mount namespaces take root and unshare (a container needs CAP_SYS_ADMIN)")
    # 12 steps after the kill's: A is killed mid-run however quickly the steps go.
    steps, path = 16, tmp_path / "mounted"  # the path both jobs see their own folder at
    path.mkdir()
    run = {**SNAPSHOTS, "training.steps": str(steps)}
    jobs, logs = {}, {}
    for name, seed in (("A", "1"), ("B", "2")):
        (tmp_path / name).mkdir()
        train = ["train", "--config", str(DEBUG_RECIPE), *tiny_overrides(path, **run, **{"job.seed": seed})]
        launch = [sys.executable, "-m", "titan", "launch", "--nnodes", "1:1", "--rdzv", f"127.0.0.1:{free_port()}",
                  "--rdzv-id", "same", "--max-restarts", "1", *train]  # fmt: skip
        inside = f"mount --bind {tmp_path / name} {path} && exec {shlex.join(launch)}"
        logs[name] = tmp_path / f"{name}.log"
        jobs[name] = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", inside], cwd=ROOT,
                                      env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=logs[name].open("w"),
                                      stderr=subprocess.STDOUT)  # fmt: skip
    try:
        metrics = {name: tmp_path / name / "debug" / "metrics.jsonl" for name in jobs}
        wait_for_step(metrics["A"], 4, list(jobs.values()), timeout=180)
        (worker,) = [pid for pid in process_tree(jobs["A"].pid)[1:]
                     if b"train" in Path(f"/proc/{pid}/cmdline").read_bytes()]  # fmt: skip
        os.kill(worker, signal.SIGKILL)
        codes = {name: job.wait(timeout=300) for name, job in jobs.items()}
    finally:
        for job in jobs.values():
            job.kill()
            job.wait()
    assert codes == {"A": 0, "B": 0}, "".join(log.read_text()[-3000:] for log in logs.values())
    folders = {name: set(re.findall(r"snapshot step \d+: \S*/(titan-snapshots-[^/]+)/", log.read_text()))
               for name, log in logs.items()}  # fmt: skip
    assert len(folders["A"]) == len(folders["B"]) == 1 and folders["A"] != folders["B"], folders
    assert "restoring the in-memory snapshot" in logs["A"].read_text()
    assert "elastic_restart" not in metrics["B"].read_text()
    assert not list(shm.iterdir())
    for name, seed in (("A", "1"), ("B", "2")):
        reference = Trainer(
            load_config(DEBUG_RECIPE, tiny_overrides(tmp_path / f"ref{name}", **run, **{"job.seed": seed}))
        )
        reference.train()
        expected = last_losses(logged_steps(reference.run_dir / "metrics.jsonl"))
        got = last_losses(logged_steps(metrics[name]))
        assert sorted(got) == list(range(1, steps + 1)), name
        for step in got:
            assert got[step]["loss"] == pytest.approx(expected[step]["loss"], rel=1e-5), (name, step)
