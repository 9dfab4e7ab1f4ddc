"""Muon with QK-clip from `titan train` trains the same on FSDP2, TP2, CP2 and PP2 as on one process, with clipping
active from the first step: each layout's losses and logged largest logits (qk_max/layer<i>) are one process's. The
heads' maxima are reduced over the ranks that split the batch (FSDP), the sequence (CP: the ring's blocks), the heads
(TP) or the layers (PP), and the clip scales each weight's rows on its shards (one process's clip:
tests/train/test_qk_clip.py)."""

import json

import pytest

from conftest import ROOT, run_titan_ranks, scenarios_beyond, tiny_overrides
from run_files import GLOBAL_BATCH, one_process_runs, recipe

# The debug model's heads start at largest logits of about 0.11 to 0.14: every layer clips from the first step. The
# MoE recipe on DeepSeek's latent attention (a query latent too) starts at about 0.07, and takes tau 0.05.
TAU = {False: "0.1", True: "0.05"}
STEPS = 10
MLA = {"kv_lora_rank": "16", "qk_nope_head_dim": "8", "qk_rope_head_dim": "4", "v_head_dim": "8", "q_lora_rank": "16"}
# name: (processes, overrides, data-parallel size); the _mla one trains the MoE recipe, the others the dense one.
LAYOUTS = {
    "fsdp2": (2, {"parallel.dp_shard": "2"}, 2),
    "tp2": (2, {"parallel.tp": "2"}, 1),
    "cp2": (2, {"parallel.cp": "2"}, 1),
    "pp2": (2, {"parallel.pp": "2"}, 1),  # each stage its layers' maxima
    "fsdp2_tp2": (4, {"parallel.dp_shard": "2", "parallel.tp": "2"}, 2),  # the rows split as _StridedShard
    "tp2_mla": (2, {"parallel.tp": "2"}, 1),  # wq_b's and wkv_b's heads split
}
DEFAULT = ("cp2",)  # the cheapest (~8 s with one process's run): the ring's blocks recorded
# Measured over 10 fp32 steps, losses and logged maxima together: 2.2e-7 relative off one process on FSDP2, 5.1e-7
# on TP2, 6.6e-7 on CP2, 2.2e-7 on PP2, 3.0e-7 on FSDP2 x TP2, 4.2e-7 on TP2 with MLA (sums in other orders); the
# bound is the 1e-5 a user is promised.
RTOL = 1e-5


def run(tmp, name: str, mla: bool, **extra) -> list[str]:
    values = {"optimizer.name": "muon", "optimizer.qk_clip_tau": TAU[mla], "training.steps": str(STEPS), **extra}
    if not mla:
        return recipe(tmp, name, **values)
    values |= {f"model.overrides.{k}": v for k, v in MLA.items()}
    values |= {"training.global_batch_size": str(GLOBAL_BATCH), "checkpoint.enable": "false", "job.name": name}
    return ["--config", str(ROOT / "recipes" / "debug_moe.toml"), *tiny_overrides(tmp, **values)]


def logged(run_dir) -> dict[int, dict[str, float]]:
    """Each step's loss and qk_max/layer<i>."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    kept = lambda r: {k: v for k, v in r.items() if k == "loss" or k.startswith("qk_max/")}  # noqa: E731
    return {r["step"]: kept(r) for r in records if "loss" in r}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One process's run, by recipe (MLA or not), made when first asked for."""
    tmp = tmp_path_factory.mktemp("single")
    runs = one_process_runs(tmp, logged)

    def one(mla: bool):
        name = f"single_{'mla' if mla else 'gqa'}"
        return runs(name, run(tmp, name, mla, **{"training.local_batch_size": str(GLOBAL_BATCH)}))

    return one


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", scenarios_beyond(DEFAULT, LAYOUTS))
def test_qk_clip_trains_and_logs_the_one_process_values_on_every_layout(tmp_path, single, name):
    mla = name.endswith("_mla")
    single = single(mla)
    assert any(v > float(TAU[mla]) for step in single.values() for k, v in step.items() if k != "loss"), "no clip"
    world, layout, dp = LAYOUTS[name]
    extra = {**layout, "training.local_batch_size": str(GLOBAL_BATCH // dp)}
    result = run_titan_ranks(world, "train", *run(tmp_path, name, mla, **extra))
    assert result.returncode == 0, result.stderr[-3000:]
    got = logged(tmp_path / name)
    assert got.keys() == single.keys() and all(got[s].keys() == single[s].keys() for s in single)
    worst = max(abs(got[s][k] - v) / abs(v) for s in single for k, v in single[s].items())
    assert worst < RTOL, f"{name}: loss or qk_max off one process by {worst:.2e} relative"
