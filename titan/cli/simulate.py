"""`titan simulate stragglers` and `titan simulate packing`."""

from __future__ import annotations

import dataclasses

import typer

from titan.cli.common import simulate_app
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
