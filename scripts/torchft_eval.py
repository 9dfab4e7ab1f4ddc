"""Evaluate torchft for replica-level recovery: a replica group drops out and rejoins while the other trains on.

    python scripts/torchft_eval.py                       # every run: a JSON line each, outputs/torchft_eval/
    python scripts/torchft_eval.py --steps 24 --kill-at 8 --down-steps 4

torchft is not a titan dependency. Install it beside the system's torch without letting pip replace torch:

    python -m venv --system-site-packages /tmp/tftenv && /tmp/tftenv/bin/pip install --no-deps torchft
    /tmp/tftenv/bin/python scripts/torchft_eval.py

Without torchft the script says so in one line and exits 0. Runs, on the CPU with gloo on 127.0.0.1 (a torchft
lighthouse in this process, two replica groups of one process each, a synchronous quorum at every step):

  reference  one process, no torchft: titan's trajectory, the whole global batch at every step
  control    two replica groups under torchft, no failure (the summation order's own difference)
  fixed      each group reads its own half of every global batch and the gradients are averaged over the groups
             present (torchft's DistributedSampler and Manager.allreduce); group 1 is killed with SIGKILL after
             step --kill-at; a spare process, started with the others, takes its place once the survivor has
             committed --down-steps more steps
  replan     the same failure, but at each step the groups in the quorum share the whole global batch (titan's run
             plan over the groups present) and the gradients are summed and divided by the global batch's tokens

The model is titan's debug Llama with dropout 0.1 from titan's counter-based RNG (masks keyed by the step and the
row in the global batch). Sample g of the run is a sequence keyed by g alone, as in titan's data order (global
sample g is row g % G of step g // G). Printed: the survivor's stall after the kill, the spare's cold start and its
rejoin (quorum and healing from the survivor's live state), and each run's loss and weights
against the reference (results.json; the lighthouse's log in lighthouse.log, each process's in its .err).
docs/torchft.md has the measurements and what they mean for titan.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GLOBAL_BATCH = 8
SEQ = 64
DROPOUT = 0.1
LR = 1e-3


def sample(g: int, vocab: int):
    """Global sample g: a run of tokens with a start and a stride drawn from g alone (learnable in context)."""
    import torch

    gen = torch.Generator().manual_seed(g)
    start = int(torch.randint(0, vocab, (1,), generator=gen))
    stride = int(torch.randint(1, 17, (1,), generator=gen))
    return (start + stride * torch.arange(SEQ + 1)) % vocab


def build(seed: int):
    import torch

    from titan.models import get_model_spec, model_args

    args = model_args("llama3", "debug", {"resid_dropout": DROPOUT})
    with torch.device("meta"):
        model = get_model_spec("llama3").build(args)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    model.train()
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def loss_sum(model, step: int, rows: list[int]):
    """Summed token loss of global rows `rows` of `step`, dropout keyed by the step and the rows (titan's RNG)."""
    import torch
    import torch.nn.functional as F

    from titan.rng import dropout_step

    tokens = torch.stack([sample(step * GLOBAL_BATCH + r, model.args.vocab_size) for r in rows])
    with dropout_step(step):
        logits = model(tokens[:, :-1], rows=torch.tensor(rows))
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum")


def share(rank: int, n: int) -> list[int]:
    """Rank `rank` of `n`'s contiguous rows of the global batch (the first ranks take the remainder)."""
    base, extra = divmod(GLOBAL_BATCH, n)
    start = rank * base + min(rank, extra)
    return list(range(start, start + base + (rank < extra)))


def reference(args) -> list[float]:
    import torch

    from titan.rng import dropout_step

    torch.set_num_threads(1)
    model, opt = build(args.seed)
    losses = []
    for step in range(args.steps):
        opt.zero_grad()
        loss = loss_sum(model, step, list(range(GLOBAL_BATCH))) / (GLOBAL_BATCH * SEQ)
        with dropout_step(step):
            loss.backward()
        opt.step()
        losses.append(loss.item())
    torch.save(model.state_dict(), args.out / "reference.pt")
    return losses


def manager_for(args, model, opt):
    """A torchft Manager for this one-process replica group, with its own TCPStore and the live state to heal from."""
    import torch
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def load(state):
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])

    timeout = timedelta(seconds=args.timeout)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=load,
        state_dict=lambda: {"model": model.state_dict(), "optim": opt.state_dict()},
        min_replica_size=1,
        use_async_quorum=False,  # the quorum is known before the step reads its rows
        timeout=timeout,
        quorum_timeout=timedelta(seconds=120),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=args.lighthouse,
        replica_id=f"replica_{args.replica}",
        hostname="127.0.0.1",
        init_sync=False,  # titan's init is a function of the seed: every group starts equal
    )
    torch.set_num_threads(1)
    return manager, store


def replica_step(manager, model, opt, policy: str, replica: int) -> dict:
    """One attempt at the manager's current step: quorum (healing if behind), the rows, one allreduce, commit."""
    import torch
    from torch.distributed import ReduceOp

    from titan.rng import dropout_step

    began, before = time.time(), manager.current_step()
    manager.start_quorum()
    step, n, rank = manager.current_step(), manager.num_participants(), manager.participating_rank()
    opt.zero_grad()
    if policy == "fixed":  # its own half whoever is present, averaged over the groups present
        rows, norm, op = share(replica, 2), GLOBAL_BATCH // 2 * SEQ, ReduceOp.AVG
    else:  # the present groups share the global batch; the sum over them is the global batch's gradient
        rows, norm, op = share(rank, n), GLOBAL_BATCH * SEQ, ReduceOp.SUM
    loss = loss_sum(model, step, rows) / norm
    with dropout_step(step):
        loss.backward()
    params = list(model.parameters())
    flat = torch.cat([p.grad.flatten() for p in params] + [loss.detach().view(1)])
    manager.allreduce(flat, reduce_op=op).wait()
    committed = manager.should_commit()
    if committed:
        torch.nn.utils.vector_to_parameters(flat[:-1], [p.grad for p in params])
        opt.step()
    return {
        "step": step, "healed_from": before if step != before else None, "participants": n, "rows": rows,
        "loss": flat[-1].item(), "committed": committed, "began": began, "ended": time.time(),
    }  # fmt: skip


def replica(args) -> None:
    """A replica group's process: build the model, wait for the go file, then train to --steps under torchft. A
    first start registers with the lighthouse before it waits (the first quorum has both groups); a spare only
    once it is let go (a group the lighthouse sees but that never asks for a quorum would hold the others back)."""
    model, opt = build(args.seed)
    early = None if args.spare else manager_for(args, model, opt)
    with open(args.log, "a") as log:
        log.write(json.dumps({"ready": time.time()}) + "\n")
        log.flush()
        while not Path(args.go).exists():
            time.sleep(0.05)
        manager, _store = early or manager_for(args, model, opt)  # the group's TCPStore lives as long as it
        while manager.current_step() < args.steps:
            log.write(json.dumps(replica_step(manager, model, opt, args.policy, args.replica)) + "\n")
            log.flush()
    import torch

    torch.save(model.state_dict(), args.out / f"{Path(args.log).stem}.pt")
    manager.shutdown(wait=False)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def committed_steps(path: Path) -> int:
    return sum(1 for r in records(path) if r.get("committed"))


def spawn(args, name: str, replica: int, lighthouse: str, go: Path, spare: bool = False) -> subprocess.Popen:
    cmd = [
        sys.executable, __file__, "replica", "--replica", str(replica), "--policy", args.policy,
        "--lighthouse", lighthouse, "--log", str(args.out / f"{name}.jsonl"), "--steps", str(args.steps),
        "--seed", str(args.seed), "--timeout", str(args.timeout), "--out", str(args.out), "--go", str(go),
    ] + (["--spare"] if spare else [])  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(args.out / f"{name}.err", "w"))


def wait_until(condition, procs, what: str, limit: float = 600) -> None:
    end = time.time() + limit
    while not condition():
        if time.time() > end or any(p.poll() not in (None, 0) for p in procs):
            raise SystemExit(f"torchft_eval: gave up waiting for {what}; see the .err files in the output folder")
        time.sleep(0.05)


def two_groups(args, run: str, kill: bool) -> dict:
    """Two replica groups under a lighthouse; with `kill`, group 1 is SIGKILLed after --kill-at steps and a spare
    process (started with the others, so its start-up is measured apart) takes its place --down-steps later."""
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=args.join_timeout_ms, heartbeat_timeout_ms=args.heartbeat_ms
    )
    args.policy = "fixed" if run == "fixed" else "replan"
    names = [f"{run}-r0", f"{run}-r1", f"{run}-r1b"][: 3 if kill else 2]
    logs = [args.out / f"{name}.jsonl" for name in names]
    gos = [args.out / f"{run}.go", args.out / f"{run}-spare.go"]
    for path in logs + gos:
        path.unlink(missing_ok=True)
    events = {"spawned": time.time()}
    procs = [spawn(args, name, min(i, 1), lighthouse.address(), gos[i // 2], i == 2) for i, name in enumerate(names)]
    wait_until(lambda: all(records(log) for log in logs), procs, f"{run}: every process ready")
    gos[0].touch()
    if kill:
        wait_until(lambda: committed_steps(logs[1]) >= args.kill_at, procs, f"{run}: step {args.kill_at}")
        procs[1].send_signal(signal.SIGKILL)
        events["killed"] = time.time()
        procs[1].wait()
        target = committed_steps(logs[0]) + args.down_steps
        wait_until(lambda: committed_steps(logs[0]) >= target, procs[:1], f"{run}: the survivor's steps")
        gos[1].touch()
        events["rejoin"] = time.time()
    for p in procs[:1] + procs[2:]:
        if p.wait():
            raise SystemExit(f"torchft_eval: a {run} replica failed (exit {p.returncode}); see {args.out}/{run}-*.err")
    procs[1].wait()
    lighthouse.shutdown()
    return {"events": events, "r0": records(logs[0]), "r1b": records(logs[2]) if kill else []}


def trajectory(log: list[dict], steps: int) -> list[float]:
    """Each step's committed loss (an attempt that did not commit is retried at the same step)."""
    by_step = {r["step"]: r["loss"] for r in log if r.get("committed")}
    return [by_step[s] for s in range(steps)]


def weights_gap(out: Path, a: str, b: str) -> float:
    """The largest difference between two runs' final weights."""
    import torch

    x, y = torch.load(out / f"{a}.pt"), torch.load(out / f"{b}.pt")
    return max((x[k] - y[k]).abs().max().item() for k in x)


def summarize(args, run: str, result: dict, ref: list[float]) -> dict:
    """The run's numbers: loss gap to the reference, and with a failure the stall, the outage and the rejoin."""
    losses = trajectory(result["r0"], args.steps)
    rel = [abs(a - b) / abs(b) for a, b in zip(losses, ref)]
    steps = [r for r in result["r0"] if "step" in r]
    row = {
        "run": run,
        "max_rel_loss_gap": max(rel),
        "final_rel_loss_gap": rel[-1],
        "max_weight_gap": weights_gap(args.out, "reference", f"{run}-r0"),
        "median_step_s": sorted(r["ended"] - r["began"] for r in steps)[len(steps) // 2],
    }
    if "killed" in result["events"]:
        killed, rejoin = result["events"]["killed"], result["events"]["rejoin"]
        after = [r for r in steps if r["ended"] > killed and r["committed"]]
        alone = [r for r in steps if r["committed"] and r["participants"] == 1]
        back = next(r for r in result["r1b"] if r.get("committed"))
        healing = next(r for r in after if r["participants"] == 2)
        row |= {
            "stall_s": after[0]["ended"] - killed,
            "failed_attempts": sum(1 for r in steps if not r["committed"]),
            "steps_alone": len(alone),
            "rows_not_trained": sum(GLOBAL_BATCH - len(r["rows"]) for r in alone),
            "alone_step_s": sorted(r["ended"] - r["began"] for r in alone)[len(alone) // 2],
            "cold_start_s": result["r1b"][0]["ready"] - result["events"]["spawned"],
            "rejoin_s": back["ended"] - rejoin,
            "survivor_heal_step_s": healing["ended"] - healing["began"],
            "healed_to_step": back["step"],
            "groups_weight_gap": weights_gap(args.out, f"{run}-r0", f"{run}-r1b"),
        }
    return row


def quiet_lighthouse(out: Path) -> None:
    """The lighthouse logs every quorum on file descriptor 2: send that to a file, Python's stderr staying put."""
    saved = os.dup(2)
    os.dup2(os.open(out / "lighthouse.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    sys.stderr = os.fdopen(saved, "w", buffering=1)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("role", nargs="?", default="main", choices=["main", "replica"])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--kill-at", type=int, default=8, help="kill group 1 once it has committed this many steps")
    p.add_argument("--down-steps", type=int, default=4, help="restart it after the survivor's next N steps")
    p.add_argument("--runs", default="control,fixed,replan")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=30.0, help="torchft's collective and RPC timeout (s)")
    p.add_argument("--heartbeat-ms", type=int, default=2000, help="the lighthouse drops a silent group after this")
    p.add_argument("--join-timeout-ms", type=int, default=1000)
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "torchft_eval")
    for name in ("--replica", "--policy", "--lighthouse", "--log", "--go"):  # a replica's own
        p.add_argument(name, type=int if name == "--replica" else str)
    p.add_argument("--spare", action="store_true")
    return p.parse_args(argv)


def main() -> None:
    try:
        import torchft  # noqa: F401
    except ImportError:
        print("torchft_eval: torchft is not installed; see the top of scripts/torchft_eval.py to install it")
        return
    args = parse()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.role == "replica":
        return replica(args)
    quiet_lighthouse(args.out)
    ref = reference(args)
    rows = [summarize(args, run, two_groups(args, run, run != "control"), ref) for run in args.runs.split(",")]
    (args.out / "results.json").write_text(json.dumps({"reference": ref, "runs": rows}, indent=1))
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
