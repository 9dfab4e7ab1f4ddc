"""`titan launch`: `titan train` under torchrun's elastic agent, started with what titan's restarts need."""

from __future__ import annotations

import os
import shlex
import sys

import typer

from titan.cli.common import app
from titan.errors import UserError

# Each restart gets a store of its own (rank 0's): in the agent's shared one a restarted worker can read a dead
# worker's address and fail to connect, restart after restart.
ENVIRONMENT = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
# A node that died leaves the rendezvous within seconds (keep-alives every second, three missed), and a new world
# forms 5 s after its first node arrives rather than torchrun's 30.
RENDEZVOUS = "last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3"
# torchrun passes these on to its workers instead of dying: SIGUSR1 is Slurm's notice before the time limit or a
# preemption, on which the workers checkpoint and exit (torchrun's default omits it).
SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def torchrun_line(nnodes: str, nproc_per_node: int, rdzv: str | None, rdzv_id: str, restarts: int,
                  store_host: bool | None, shutdown_timeout: int, args: list[str]) -> list[str]:  # fmt: skip
    """The torchrun arguments that run `titan ARGS` on this node."""
    line = ["--nnodes", nnodes, "--nproc-per-node", str(nproc_per_node), "--max-restarts", str(restarts)]
    if rdzv:
        conf = RENDEZVOUS if store_host is None else f"is_host={int(store_host)},{RENDEZVOUS}"
        line += ["--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv, "--rdzv-id", rdzv_id, "--rdzv-conf", conf]
    else:
        line += ["--standalone"]
    line += ["--signals-to-handle", SIGNALS, "--shutdown-timeout", str(shutdown_timeout), "--monitor-interval", "1"]
    return [*line, "-m", "titan", *args]


def slurm_store_host() -> bool | None:
    """Under Slurm, whether this is the job's first node, whose agent hosts the rendezvous store (None elsewhere:
    torchrun then hosts it on the node whose address --rdzv names)."""
    node = os.environ.get("SLURM_NODEID")
    return None if node is None else node == "0"


@app.command(
    "launch", context_settings={"allow_extra_args": True, "ignore_unknown_options": True}, no_args_is_help=True
)
def launch(
    ctx: typer.Context,
    nnodes: str = typer.Option(
        "1",
        "--nnodes",
        help="Nodes: N, or MIN:MAX for an elastic run that goes on with as few as MIN (each node runs this command).",
    ),  # fmt: skip
    nproc_per_node: int = typer.Option(1, "--nproc-per-node", help="Processes on this node: one per GPU."),
    rdzv: str = typer.Option(None, "--rdzv", help="HOST:PORT of the first node, where the nodes meet."),
    rdzv_id: str = typer.Option(
        os.environ.get("SLURM_JOB_ID", "titan"), "--rdzv-id", help="The job's name, the same on every node."
    ),
    max_restarts: int = typer.Option(
        None, "--max-restarts", help="Restarts after a failure; default 3 for MIN:MAX nodes, else 0."
    ),
    store_host: bool = typer.Option(
        None,
        "--store-host/--no-store-host",
        help="Whether this node hosts the rendezvous store (default: under Slurm the job's first node; elsewhere "
        "the node whose address --rdzv names).",
    ),
    shutdown_timeout: int = typer.Option(
        100, "--shutdown-timeout", help="Seconds the workers get to checkpoint after a signal before SIGKILL."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the torchrun line and exit."),
) -> None:
    """Run titan train under torchrun's elastic agent.

    One agent per node, for example on each of 2 to 4 nodes: titan launch --nnodes 2:4 --nproc-per-node 8 --rdzv
    node0:29500 train -c recipe.toml. Sets the environment and rendezvous settings that titan's restarts need
    (docs/fault-tolerance.md) and prints the torchrun line it runs; plain torchrun keeps working.
    """
    args = list(ctx.args)
    if args[:1] != ["train"]:
        raise UserError("titan launch runs `titan train`: end the command with train and its options, e.g. "
                        "titan launch --nproc-per-node 2 train -c recipes/debug.toml")  # fmt: skip
    elastic = ":" in nnodes
    if not rdzv and nnodes not in ("1", "1:1"):
        raise UserError(f"--nnodes {nnodes} needs --rdzv HOST:PORT: the first node's address, where the nodes meet")
    restarts = max_restarts if max_restarts is not None else 3 if elastic else 0
    store_host = slurm_store_host() if store_host is None else store_host
    line = torchrun_line(nnodes, nproc_per_node, rdzv, rdzv_id, restarts, store_host, shutdown_timeout, args)
    shown = " ".join(f"{k}={v}" for k, v in ENVIRONMENT.items())
    typer.echo(f"titan launch: {shown} torchrun {shlex.join(line)}", err=True)
    if dry_run:
        return
    sys.stderr.flush()
    command = [sys.executable, "-m", "torch.distributed.run", *line]  # torchrun, of this Python
    os.execve(sys.executable, command, {**os.environ, **ENVIRONMENT})
