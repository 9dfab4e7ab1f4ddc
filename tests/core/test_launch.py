"""`titan launch`: the torchrun line titan's elastic runs need, printed before it runs."""

from conftest import run_titan
from helpers import assert_one_line_error


def test_launch_prints_the_torchrun_line_with_what_restarts_need():
    result = run_titan("launch", "--dry-run", "--nnodes", "2:4", "--nproc-per-node", "8", "--rdzv", "node0:29500",
                       "--rdzv-id", "job7", "train", "-c", "recipes/debug.toml", "--training.steps", "9")  # fmt: skip
    assert result.returncode == 0 and result.stdout == "", result.stderr
    assert result.stderr == (
        "titan launch: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 2:4 --nproc-per-node 8 --max-restarts 3 "
        "--rdzv-backend c10d --rdzv-endpoint node0:29500 --rdzv-id job7 --rdzv-conf "
        "last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3 --signals-to-handle "
        "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout 100 --monitor-interval 1 "
        "-m titan train -c recipes/debug.toml --training.steps 9\n"
    )
    # Under Slurm the job's first node hosts the rendezvous store, whatever its address resolves to.
    for node, is_host in (("0", 1), ("1", 0)):
        slurm = run_titan("launch", "--dry-run", "--nnodes", "1:2", "--rdzv", "node0:29500", "train", "-c", "x.toml",
                          env={"SLURM_NODEID": node})  # fmt: skip
        assert f"--rdzv-conf is_host={is_host},last_call_timeout=5," in slurm.stderr, slurm.stderr
    one_node = run_titan("launch", "--dry-run", "--nproc-per-node", "2", "train", "-c", "recipes/debug.toml")
    assert "torchrun --nnodes 1 --nproc-per-node 2 --max-restarts 0 --standalone --signals-to-handle" in one_node.stderr


def test_launch_refuses_what_it_cannot_run_in_one_line():
    assert_one_line_error(run_titan("launch", "--nnodes", "2", "train", "-c", "x.toml"), "--nnodes 2 needs --rdzv")
    assert_one_line_error(
        run_titan("launch", "--nproc-per-node", "2", "-c", "x.toml"), "titan launch runs `titan train`"
    )
