"""`titan simulate stragglers`, `titan simulate packing` and `titan simulate failures`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import typer

from titan.cli.common import CONFIG_OPTION, recipe_command, simulate_app
from titan.errors import UserError


@simulate_app.command("stragglers")
def simulate_stragglers(
    devices: int = typer.Option(1024, help="Devices in the cluster."),
    tp: int = typer.Option(8, help="Tensor-parallel degree."),
    pp: int = typer.Option(1, help="Pipeline-parallel degree."),
    steps: int = typer.Option(300, help="Training steps to simulate."),
    local_batch_size: int = typer.Option(8, help="Most rows per micro-batch (4,096 rows per step)."),
    slow_factor: float = typer.Option(3.0, help="One device this many times slower ..."),
    slow_start: int = typer.Option(50, help="... from this step ..."),
    slow_end: int = typer.Option(150, help="... to this one."),
    blip_rate: float = typer.Option(1e-5, help="Chance per device and step of a brief slowdown."),
    seed: int = typer.Option(0),
) -> None:
    """Compare ways of sharing work with stragglers.

    Static even shares, titan's straggler re-planning, and an oracle, on one speed trace."""
    from titan.tools.simulate.stragglers import Scenario, compare

    if devices % (tp * pp):
        raise UserError(f"--devices {devices} is not a multiple of --tp x --pp = {tp * pp}")
    s = Scenario(devices, tp, pp, steps, local_batch_size=local_batch_size, slow_factor=slow_factor,
                 slow_start=slow_start, slow_end=slow_end, blip_rate=blip_rate, seed=seed)  # fmt: skip
    try:
        results = compare(s)
    except ValueError as e:
        raise UserError(f"no runnable plan: {e}") from None
    typer.echo(
        f"{s.devices} devices, {s.replicas} data-parallel replicas of tp {tp} x pp {pp}, {steps} steps, "
        f"micro-batches of at most {local_batch_size} rows"
    )
    typer.echo(f"{'policy':<8}{'rows/s':>10}{'slow phase rows/s':>19}{'re-plans':>10}")
    for policy, r in results.items():
        typer.echo(f"{policy:<8}{r['rows_per_s']:>10,.0f}{r['slow_phase_rows_per_s']:>19,.0f}{r['replans']:>10}")


@simulate_app.command("packing")
def simulate_packing(
    replicas: int = typer.Option(64, help="Data-parallel replicas."),
    steps: int = typer.Option(10, help="Steps (global batches) to simulate."),
    flavor: list[str] = typer.Option(["8B", "1B"], help="Llama 3 flavors whose FLOPs make the cost model."),
    seed: int = typer.Option(0),
    cp: int = typer.Option(
        1, help="Context-parallel degree: > 1 compares placements of documents up to 128k tokens on cp groups."
    ),
) -> None:
    """Compare packings of long-tailed documents.

    Token-balanced against cost-balanced packing, without and with a 4-stage pipeline: mean predicted step time, a lower
    bound no placement beats, imbalance (slowest replica over mean) and planning time. With --cp: static context
    parallelism against CP placement."""
    from titan.tools.simulate.packing import PackingScenario, simulate

    if cp > 1:
        _simulate_packing_cp(replicas, steps, flavor, seed, cp)
        return
    typer.echo(
        f"{replicas} replicas, {steps} steps; documents lognormal (median 1024, sigma 1.0) clipped at 32k; "
        "32k tokens per micro-batch"
    )
    typer.echo(f"{'flavor':<8}{'pp':>3}{'tokens s/step':>15}{'cost s/step':>13}{'bound s/step':>14}"
               f"{'speed-up':>10}{'imbalance tokens/cost':>23}{'plan ms':>9}")  # fmt: skip
    for name in flavor:
        for pp, micro_batches in ((1, 2), (4, 8)):
            r = simulate(PackingScenario(replicas, pp, name, micro_batches=micro_batches, steps=steps, seed=seed))
            typer.echo(
                f"{name:<8}{pp:>3}{r['tokens_step_s']:>15.3f}{r['cost_step_s']:>13.3f}{r['bound_step_s']:>14.3f}"
                f"{r['speedup']:>9.3f}x"
                f"{r['tokens_imbalance']:>14.3f} / {r['cost_imbalance']:.3f}{r['plan_ms']:>9.0f}"
            )


def _simulate_packing_cp(replicas: int, steps: int, flavors: list[str], seed: int, cp: int) -> None:
    from titan.tools.simulate.packing import CP_POLICIES, PackingScenario, simulate_cp

    if replicas % cp:
        raise UserError(f"--replicas {replicas} do not form cp groups of --cp {cp}")
    scenario = PackingScenario(
        replicas, cp=cp, capacity=131072 // cp, max_len=131072, sigma=1.5, steps=steps, seed=seed
    )
    typer.echo(
        f"{replicas} ranks ({replicas // cp} cp groups of {cp}), {steps} steps; documents lognormal (median "
        f"{scenario.median_len}, sigma {scenario.sigma}) clipped at 128k; rows of 128k tokens, {scenario.capacity} "
        f"per rank; ring links {scenario.link_bytes_per_s / 1e9:.0f} GB/s"
    )
    for key, policy in CP_POLICIES.items():
        typer.echo(f"  {key}: {policy}")
    typer.echo(
        f"{'flavor':<8}{'policy':<8}{'s/step':>9}{'over bound':>12}{'imbalance':>11}{'plan ms':>9}{'speed-up':>10}"
    )
    for name in flavors:
        results = simulate_cp(dataclasses.replace(scenario, flavor=name))
        for key in CP_POLICIES:
            r = results[key]
            speedup = results["tokens"]["step_s"] / r["step_s"]
            typer.echo(
                f"{name:<8}{key:<8}{r['step_s']:>9.3f}{r['over_bound']:>11.3f}x{r['imbalance']:>11.3f}"
                f"{r['plan_ms']:>9.0f}{speedup:>9.2f}x"
            )
        typer.echo(f"{name:<8}{'bound':<8}{results['bound']['step_s']:>9.3f}")


@recipe_command("failures", simulate_app)
def simulate_failures(
    ctx: typer.Context,
    config: Path = CONFIG_OPTION,
    world_size: int = typer.Option(None, "--world-size", help="Devices the run uses; default: the recipe's degrees."),
    mtbf_hours: float = typer.Option(
        None, help="Mean time between failures of the whole job, in hours; default: 2 (unless --node-mtbf-hours)."
    ),
    node_mtbf_hours: float = typer.Option(
        None, help="Instead: the mean time between failures of one node; the job's is it divided by the nodes."
    ),
    every_minutes: str = typer.Option("10,30,60", help="Disk checkpoint intervals to compare, in minutes."),
    every_steps: str = typer.Option("1,10,100", help="In-memory snapshot intervals to compare, in steps."),
    disk_write_gbs: float = typer.Option(2.0, help="Checkpoint write bandwidth per node, GB/s."),
    disk_read_gbs: float = typer.Option(4.0, help="Checkpoint read bandwidth per node, GB/s."),
    host_gbs: float = typer.Option(0.0, help="Device to host memory copy, GB/s per device; 0: the device's link."),
    network_gbs: float = typer.Option(0.0, help="Snapshot copy to the buddy node, GB/s per node; 0: one NIC."),
    relaunch_s: float = typer.Option(
        None, help="Seconds to relaunch the job; default: 300, or with --measure, measured."
    ),
    elastic_restart_s: float = typer.Option(
        None, help="Seconds for torchrun to restart the workers; default: 60, or with --measure, measured."
    ),
    measure: bool = typer.Option(
        False, "--measure", help="Measure this machine's save, load, snapshot and restart times on the debug recipe."
    ),
    failures: int = typer.Option(200_000, help="Failures the Monte Carlo simulation draws."),
    seed: int = typer.Option(0, help="The Monte Carlo simulation's seed."),
) -> None:
    """Compare goodput with disk checkpoints and in-memory snapshots.

    For the recipe on its world size, titan plan's step time and per-rank state, and the save, restore and restart
    costs from the bandwidths and latencies given (or measured with --measure): the share of time spent training with
    disk checkpoints every K minutes and with in-memory snapshots every N steps, each by the formula and by Monte
    Carlo, and the intervals Young/Daly's sqrt(2 x save cost x MTBF) gives."""
    from titan.config import degrees_world_size, load_config, read_config
    from titan.tools.simulate import failures as model

    _require(mtbf_hours is None or node_mtbf_hours is None, "give --mtbf-hours or --node-mtbf-hours, not both")
    minutes, steps = _intervals("--every-minutes", every_minutes, float), _intervals("--every-steps", every_steps, int)
    positive = {"--world-size": world_size, "--mtbf-hours": mtbf_hours, "--node-mtbf-hours": node_mtbf_hours,
                "--failures": failures, "--disk-write-gbs": disk_write_gbs,
                "--disk-read-gbs": disk_read_gbs}  # fmt: skip
    for name, value in positive.items():
        _require(value is None or value > 0, f"{name} must be > 0, got {value}")
    for name, value in {"--host-gbs": host_gbs, "--network-gbs": network_gbs, "--relaunch-s": relaunch_s,
                        "--elastic-restart-s": elastic_restart_s}.items():  # fmt: skip
        _require(value is None or value >= 0, f"{name} must be >= 0, got {value}")
    if world_size is None:
        world_size = degrees_world_size(read_config(config, ctx.args).parallel)
    workload = model.planned_workload(load_config(config, ctx.args, world_size=world_size), world_size)
    measured = _measure() if measure else None
    restarts = {"relaunch_s": relaunch_s, "elastic_restart_s": elastic_restart_s}
    sources = {k: "given" if v is not None else "measured" if measured else "assumed" for k, v in restarts.items()}
    restarts = {k: v if v is not None else getattr(measured or model.Assumptions(), k) for k, v in restarts.items()}
    assumed = model.Assumptions(disk_write_gbs, disk_read_gbs, host_gbs, network_gbs, **restarts)
    costs = model.costs(workload, assumed)
    mtbf_s, mtbf_text = _job_mtbf(mtbf_hours, node_mtbf_hours, workload.nodes)
    typer.echo(model.format_costs(workload, assumed, costs, sources))
    typer.echo(f"mean time between failures {mtbf_text}")
    chosen = model.policies(workload.step_s, costs, mtbf_s, minutes, steps)
    typer.echo(model.format_table(chosen, mtbf_s, failures, seed))


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise UserError(message)


def _job_mtbf(job_hours: float | None, node_hours: float | None, nodes: int) -> tuple[float, str]:
    """The job's mean time between failures in seconds, and where it comes from: given, or a node's over the nodes
    (any node's failure stops the job)."""
    if node_hours is None:
        return (job_hours or 2.0) * 3600, f"{job_hours or 2.0:g} h for the whole job"
    return (
        node_hours * 3600 / nodes,
        f"{node_hours / nodes:.3g} h: {node_hours:g} h per node over {nodes} node{'s' * (nodes > 1)}",
    )


def _intervals(option: str, text: str, kind: type) -> list:
    """`--every-minutes 10,30,60` (or --every-steps): the intervals to compare, each > 0."""
    try:
        values = [kind(item) for item in text.split(",")]
    except ValueError:
        values = []
    _require(bool(values) and min(values) > 0, f"{option} {text}: give intervals > 0 separated by commas, e.g. "
             f"{option} {'10,30,60' if kind is float else '1,10,100'}")  # fmt: skip
    return values


def _measure():
    """This machine's times for the debug model, printed before they are used."""
    from titan.config import Config
    from titan.tools.simulate.measure import measure

    m = measure(Config())  # the default recipe: the debug model
    typer.echo(
        f"measured on this machine, the debug model ({m.state_bytes / 2**20:.3g} MiB of weights and AdamW state): "
        f"DCP save {m.save_s:.3g} s, load {m.load_s:.3g} s, copy to shared memory {m.snapshot_s:.3g} s; torchrun "
        f"launch to a joined process group {m.relaunch_s:.3g} s, restart of a dead worker {m.elastic_restart_s:.3g} s"
    )
    return m
