"""Why a run restarted. Under torchrun, a worker that fails writes one line of why into the run folder (which every
node sees) before it exits: its rank, step and error. After the restart, rank 0 reads what the previous
generation wrote and says it in the restart's line; a rank that wrote nothing was killed, or its node was lost.

A worker that failed only because a peer stopped answering (gloo's "Connection reset by peer" on the survivors
of a lost node) says so in one line instead of the collective's traceback: the peer's failure is the news."""

from __future__ import annotations

import json
import logging
import re
import shutil
import sys
from pathlib import Path

from titan.launcher import Launch
from titan.train.stop import Preempted

log = logging.getLogger("titan")
FOLDER = "failures"  # in the run folder: rank-R.json, the latest failure of each rank
PEER_LOST = re.compile(r"Connection (reset|closed) by peer|Broken pipe|Connection refused|Timed out waiting")


def peer_lost(error: BaseException) -> bool:
    """Whether `error` is a collective's that lost its peer (the rank itself is healthy)."""
    return isinstance(error, RuntimeError) and PEER_LOST.search(str(error)) is not None


def first_line(error: BaseException) -> str:
    """The error in one line: gloo's own words, without the source path it starts with."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\] ", "", text)[:200]


def record(run_dir: Path, rank: int, world: int, step: int | None, what: str) -> None:
    """This rank's failure, for the next generation's restart line (written whole or not at all)."""
    folder = Path(run_dir) / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    entry = {"restart": Launch.from_env().restart, "rank": rank, "world": world, "step": step, "what": what}
    tmp = folder / f".rank-{rank}.json.tmp"
    tmp.write_text(json.dumps(entry))
    tmp.replace(folder / f"rank-{rank}.json")


def recorder(run_dir: Path, rank: int, world: int):
    """record(...) for this rank, as a function of (step, what) that records only where torchrun restarts."""

    def told(step: int | None, what: str) -> None:
        if Launch.from_env().restarts_left > 0:
            record(run_dir, rank, world, step, what)

    return told


def why_restarted(run_dir: Path) -> str:
    """What the workers before this restart wrote of why they stopped, in one line."""
    entries = []
    try:
        paths = sorted((Path(run_dir) / FOLDER).glob("rank-*.json"))
    except FileNotFoundError:  # rank 0 clears the folder as the other ranks start (pathlib lists it after is_dir)
        paths = []
    for path in paths:
        try:
            entry = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        fields = {"rank": int, "world": int, "what": str}
        if isinstance(entry, dict) and all(isinstance(entry.get(k), t) for k, t in fields.items()):
            if 0 <= entry["rank"] < entry["world"] <= 1 << 20 and isinstance(entry.get("step"), (int, type(None))):
                entries.append({**entry, "what": entry["what"][:200]})
    if not entries:
        return "no worker wrote why (killed, or their nodes lost)"
    said = sorted(entries, key=lambda e: e["rank"])
    parts = [f"rank {e['rank']}" + (f" at step {e['step']}" if e["step"] is not None else "") + f": {e['what']}"
             for e in said]  # fmt: skip
    silent = sorted(set(range(max(e["world"] for e in said))) - {e["rank"] for e in said})
    if silent:
        ranks = ", ".join(map(str, silent))
        parts.insert(0, f"rank{'s' * (len(silent) > 1)} {ranks} wrote nothing (killed, or the node lost)")
    return "; ".join(parts)


def log_restart(metrics, restart: int, step: int, rank: int, world_size: int, layout: str, run_dir: Path) -> None:
    """After restart `restart` (0: the first start, which logs nothing), its line with why, and its record in
    `metrics` (a MetricsLogger): the time from a failure to the next step is read from that record on. Rank 0 then
    clears the records, which were this start's news (torchrun counts no restart where a node joins, so the count
    cannot tell the generations apart)."""
    if restart:
        log.info("elastic restart %d: a world of %d (%s), continuing at step %d; before it, %s", restart,
                 world_size, layout, step, why_restarted(run_dir))  # fmt: skip
        metrics.log(step, {"elastic_restart": restart, "world_size": world_size})
    if rank == 0:
        shutil.rmtree(Path(run_dir) / FOLDER, ignore_errors=True)


def report(error: BaseException, run_dir: Path, step: int | None) -> bool:
    """Under torchrun with a restart left, record why this worker stops (a failure, or a preemption's stop); one
    that lost a peer also says so in one line on stderr. Returns whether it said so (its caller then exits 1
    without the traceback)."""
    under_agent = Launch.from_env().agent  # whose SIGTERM takes a node in, restarts left or not
    launch = Launch.from_env()
    if launch.restarts_left <= 0 and not (under_agent and isinstance(error, Preempted)):
        return False
    rank, world = launch.rank, launch.world
    lost = peer_lost(error)
    what = f"lost a peer ({first_line(error)})" if lost else first_line(error)
    if isinstance(error, Preempted):  # by its agent, as a node joins, or by the job's end
        what = f"stopped by {error.reason}, its checkpoint saved"
    record(run_dir, rank, world, step, what)
    if lost:
        at = f" at step {step}" if step is not None else ""
        sys.stderr.write(f"titan: rank {rank}{at} {what}; exiting so that torchrun restarts the workers\n")
        sys.stderr.flush()
    return lost
