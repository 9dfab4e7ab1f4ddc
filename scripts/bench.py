"""Benchmark a recipe: step time, tokens/s, MFU and peak memory, as a table and as JSON.

    python scripts/bench.py --config recipes/debug.toml --steps 30 [--section.key value ...]
    python scripts/bench.py --compare layouts     # single process vs FSDP2, TP2, PP2, FSDP2xTP2, PP2xFSDP2
    python scripts/bench.py --compare float8      # titan with float8.enable false and true
    python scripts/bench.py --compare dropout     # dropout 0 vs 0.1 (the counter-based RNG's cost)
    python scripts/bench.py --compare compile     # eager vs torch.compile of each block
    python scripts/bench.py --compare checkpoint  # how long a save blocks training, sync vs async
    python scripts/bench.py --compare packing     # FSDP2, long-tailed documents: token- vs cost-balanced placement
    python scripts/bench.py --compare cp          # seq 4,096: one process vs CP2 (the sequence split, a ring)
    python scripts/bench.py --compare moe         # debug MoE: one process vs FSDP2 vs EP2, and where its step goes
    python scripts/bench.py --init-flavors debug,1B  # seconds to initialise each flavor on this machine
    python scripts/bench.py --data                # prepare and loader throughput, resume time far into training
    python scripts/bench.py --verify-flavor 1B    # seconds to check a checkpoint of that flavor against its manifest
    python scripts/bench.py --experts             # routed experts: one grouped matmul vs a loop over the experts
    python scripts/bench.py --gpu [--layers 4]    # 8B-shaped layers at seq 8,192 on one GPU, next to titan plan
    python scripts/bench.py --gpu --dry-run       # the same runs on a tiny shape, on the CPU (scripts/gpu_check.sh)

The default compares titan's trainer with a bare PyTorch loop (same model and init, one fixed batch, AdamW fused
as titan's, no data loading, logging or clipping): the ratio is what the framework costs on top of the math.
Each run is its own process (torchrun for layouts), so peak memory is its own. Step time is the median over
the steps after warm-up. Layouts keep the global batch: local batch = global batch / data-parallel size.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name -> (processes, overrides)
LAYOUTS = {
    "single": (1, []),
    "fsdp2": (2, ["--parallel.dp_shard", "2"]),
    "tp2": (2, ["--parallel.tp", "2", "--parallel.dp_shard", "1"]),
    "pp2": (2, ["--parallel.pp", "2", "--parallel.dp_shard", "1"]),
    "fsdp2_tp2": (4, ["--parallel.dp_shard", "2", "--parallel.tp", "2"]),
    "pp2_fsdp2": (4, ["--parallel.pp", "2", "--parallel.dp_shard", "2"]),
}
# name -> [(label, mode, processes, overrides)]
COMPARISONS = {
    "bare": [("bare", "bare", 1, []), ("titan", "titan", 1, [])],
    "float8": [
        ("titan", "titan", 1, ["--float8.enable", "false"]),
        ("float8", "titan", 1, ["--float8.enable", "true"]),
    ],
    "compile": [("eager", "titan", 1, []), ("compiled", "titan", 1, ["--compile.enable", "true"])],
    "dropout": [
        ("dropout0", "titan", 1, []),
        ("dropout0.1", "titan", 1, ["--model.overrides.resid_dropout", "0.1", "--model.overrides.attn_dropout", "0.1"]),
    ],
    "checkpoint": [
        ("sync", "titan", 1, ["--checkpoint.enable", "true", "--checkpoint.interval", "5"]),
        (
            "async",
            "titan",
            1,
            ["--checkpoint.enable", "true", "--checkpoint.interval", "5", "--checkpoint.async_save", "true"],
        ),
    ],
    "layouts": [(name, "titan", n, extra) for name, (n, extra) in LAYOUTS.items()],
    "cp": [("single", "titan", 1, []), ("cp2", "titan", 2, ["--parallel.cp", "2", "--parallel.dp_shard", "1"])],
    # A mixture of experts (recipes/debug_moe.toml unless --config), the same global batch on each.
    "moe": [
        ("single", "titan", 1, []),
        ("fsdp2", "titan", 2, ["--parallel.dp_shard", "2"]),
        ("ep2", "titan", 2, ["--parallel.dp_shard", "2", "--parallel.ep", "2"]),
    ],
    # Whole documents per step on two ranks (the corpus is made by long_tailed_corpus): placed by tokens, by cost.
    "packing": [
        (balance, "titan", 2, ["--parallel.dp_shard", "2", "--data.batching", "tokens", "--data.balance", balance])
        for balance in ("tokens", "cost")
    ],
}
# One long sequence per step, the same global batch on one process and split over a CP2 ring.
CP_RECIPE = [
    *("--training.seq_len", "4096", "--model.overrides.max_seq_len", "4096"),
    *("--training.local_batch_size", "1", "--training.global_batch_size", "1"),
]
PACKING_RECIPE = [
    *("--training.seq_len", "4096", "--model.overrides.max_seq_len", "4096"),
    *("--training.local_batch_size", "1", "--training.global_batch_size", "4"),
    *("--validation.interval", "0", "--tokenizer.path", str(ROOT / "data" / "tokenizer.json")),
]


# Where a mixture of experts' step goes, by the profiler's marks (titan's moe.* and torch's backward nodes) on the
# training thread: the all-to-all (dispatch and combine forward, with the counts' exchange, and their backward),
# the routed experts' grouped matmuls forward and backward, and the router forward (its backward is unmarked).
MOE_PARTS = {
    "all-to-all": ("moe.dispatch", "moe.combine", "all_to_all_single_defaultBackward", "wait_tensor_defaultBackward"),
    "experts": ("moe.experts", "GroupedMmBackward0"),
    "router": ("moe.router",),
}


def step_shares(trace: Path, parts: dict[str, tuple[str, ...]]) -> dict[str, float]:
    """Each part's share of the traced steps' wall time, from a profiler trace (Chrome format): the time its events
    cover on the thread that ran the steps, nested or overlapping events counted once."""
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    steps = [e for e in events if e["name"].startswith("ProfilerStep#")]
    thread = steps[0]["tid"]

    def covered(patterns: tuple[str, ...]) -> float:
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                       if e["tid"] == thread and any(p in e["name"] for p in patterns))  # fmt: skip
        total, end = 0.0, float("-inf")
        for start, stop in spans:
            total += max(0.0, stop - max(start, end))
            end = max(end, stop)
        return total

    wall = sum(e["dur"] for e in steps)
    return {part: covered(patterns) / wall for part, patterns in parts.items()}


def long_tailed_corpus(path: Path, documents: int = 3000, seed: int = 0) -> Path:
    """Documents of the project's stories, each 1 to ~30 stories joined (lognormal): most a few hundred tokens,
    a long tail up to 4k and beyond (split at seq_len)."""
    import random

    stories = [json.loads(line)["text"] for line in (ROOT / "data" / "stories.jsonl").read_text().splitlines()]
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(documents):
            count = min(30, max(1, round(rng.lognormvariate(0.0, 1.3))))
            f.write(json.dumps({"text": "\n\n".join(rng.choice(stories) for _ in range(count))}) + "\n")
    return path


def measure(mode: str, recipe: str, steps: int, warmup: int, overrides: list[str]) -> dict:
    import torch
    import torch.nn.functional as F

    from titan.config import load_config
    from titan.data import build_loaders
    from titan.observe.metrics import peak_flops, peak_memory_bytes
    from titan.run_plan import run_plan
    from titan.train.build import build_model
    from titan.train.device import pick_device
    from titan.train.model import resolve_model
    from titan.train.trainer import Trainer

    run_dir = os.environ.get("TITAN_BENCH_DIR") or tempfile.mkdtemp(prefix="titan-bench-")
    overrides = [
        "--training.steps",
        str(steps),
        "--lr_scheduler.warmup_steps",  # the lr does not change the speed; the recipe's warmup may outlast the run
        "0",
        "--metrics.wandb",
        "disabled",
        "--metrics.tensorboard",
        "false",
        "--metrics.log_freq",
        str(steps),
        "--checkpoint.enable",
        "false",
        "--job.output_dir",
        run_dir,
        *overrides,
    ]
    config = load_config(recipe, overrides)
    blocked, shares = [], {}
    if mode == "titan":
        trainer = Trainer(config)
        trainer.train()
        times, device, world = trainer.step_times, trainer.device, trainer.world_size
        tokens_per_step = trainer.run_plan.tokens_per_step
        if config.profiling.enable:
            traces = sorted((config.run_dir / "profiling").glob(f"rank{trainer.rank}-step*.pt.trace.json"))
            shares = step_shares(traces[-1], MOE_PARTS)
        metrics = config.run_dir / "metrics.jsonl"
        if trainer.rank == 0 and metrics.exists():
            records = [json.loads(line) for line in metrics.read_text().splitlines()]
            blocked = [r["checkpoint_blocked_s"] for r in records if "checkpoint_blocked_s" in r]
    else:
        device, world = pick_device(config.training.device)[0], 1
        model = build_model(config, device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.optimizer.lr, fused=True)
        plan = list(run_plan(config, 1).micro_batches[0])
        micro, accumulation = plan[0], len(plan)
        batch = next(build_loaders(config, micro, range(micro), [micro])[0])[0].to(device)
        bf16 = config.training.mixed_precision == "bf16"
        tokens_per_step = batch.inputs.numel() * accumulation
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            for _ in range(accumulation):
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                    logits = model(batch.inputs, batch.rows, batch.document_ids)
                F.cross_entropy(logits.flatten(0, 1).float(), batch.labels.flatten()).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
    resolved = resolve_model(config)
    spec, model_args = resolved.spec, resolved.args
    step_time = statistics.median(times[warmup:])
    tokens_per_s = tokens_per_step / step_time
    flops = tokens_per_s * spec.flops_per_token(model_args, config.training.seq_len)
    return {
        "step_time_ms": 1000 * step_time,
        "tokens_per_s": tokens_per_s,
        "mfu": flops / (peak * world) if (peak := peak_flops(device, config.metrics.peak_flops)[0]) else float("nan"),
        "peak_memory_gib": peak_memory_bytes(device) / 2**30,
        "checkpoint_blocked_ms": 1000 * statistics.median(blocked) if blocked else None,
        "step_shares": shares,
        "device": str(device),
        "world_size": world,
    }


def run(label: str, mode: str, processes: int, args, overrides: list[str]) -> dict:
    """One measurement in fresh processes; returns rank 0's result with every rank's peak memory."""
    with tempfile.TemporaryDirectory(prefix="titan-bench-") as out:
        child = [
            __file__,
            "--_mode",
            mode,
            "--_out",
            out,
            "--config",
            args.config,
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            *overrides,
        ]
        if processes == 1:
            cmd = [sys.executable, *child]
        else:
            cmd = [
                "torchrun",
                "--nproc-per-node",
                str(processes),
                "--master-port",
                str(29500 + os.getpid() % 1000),
                *child,
            ]
        env = {
            **os.environ,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // processes))),
        }
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
        if done.returncode != 0:
            sys.exit(f"{label} run failed:\n{done.stderr[-4000:]}")
        ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"), key=lambda p: int(p.stem[4:]))]
    return {**ranks[0], "run": label, "peak_memory_gib_per_rank": [r["peak_memory_gib"] for r in ranks]}


def init_times(flavors: list[str], recipe: str) -> None:
    import torch

    from titan.config import load_config
    from titan.train.build import build_model

    print(f"{'flavor':<8}{'parameters':>16}{'init s':>10}")
    for flavor in flavors:
        config = load_config(recipe, ["--model.flavor", flavor, "--training.seq_len", "2048"])
        start = time.perf_counter()
        model = build_model(config, torch.device("cpu"))
        seconds = time.perf_counter() - start
        print(f"{flavor:<8}{sum(p.numel() for p in model.parameters()):>16,}{seconds:>10.1f}")
        del model


def data_figures(recipe: str, overrides: list[str], workers: int) -> None:
    """Prepare throughput (1 and `workers` tokenizer processes, in a fresh cache), the loader's throughput for
    one rank, and the time to restore a loader far into training."""
    from titan.config import load_config
    from titan.data import build_loaders
    from titan.data.prepared import prepare
    from titan.run_plan import run_plan

    with tempfile.TemporaryDirectory(prefix="titan-bench-data-") as cache:
        config = load_config(recipe, [*overrides, "--data.cache_dir", cache])
        print(f"{'prepare':<32}{'documents':>10}{'tokens':>12}{'seconds':>9}{'tokens/s':>12}")
        for n in sorted({1, workers}):
            for source in config.data.source_list():
                start = time.perf_counter()
                path = prepare(source, config.tokenizer, Path(cache) / f"workers{n}", workers=n, progress=False)
                seconds = time.perf_counter() - start
                meta = json.loads((path / "meta.json").read_text())
                label = f"{Path(source.source).name}, {n} worker{'s' if n > 1 else ''}"
                rate = meta["tokens"] / seconds
                print(f"{label:<32}{meta['documents']:>10,}{meta['tokens']:>12,}{seconds:>9.2f}{rate:>12,.0f}")
        t = config.training
        global_batch = t.global_batch_size or t.local_batch_size
        loader, _ = build_loaders(config, global_batch, range(global_batch), list(run_plan(config, 1).micro_batches[0]))
        steps, start = 200, time.perf_counter()
        for _ in range(steps):
            next(loader)
        seconds = time.perf_counter() - start
        print(
            f"loader, one rank reading the whole global batch of {global_batch} x {t.seq_len}: "
            f"{steps * global_batch * t.seq_len / seconds:,.0f} tokens/s ({1000 * seconds / steps:.2f} ms per step)"
        )
        start = time.perf_counter()
        loader.load_state_dict({"next_sample": 10_000_000})
        next(loader)
        print(f"resume at global sample 10,000,000 and read one step: {1000 * (time.perf_counter() - start):.1f} ms")


def verify_figures(flavor: str, recipe: str, files: int = 8) -> None:
    """Write files of the size of `flavor`'s checkpoint (fp32 weights and two Adam moments, split over `files`
    shards as `files` ranks would write them), then time the manifest check a resume runs. SHA-256 costs the
    same whatever the bytes, so the files hold random bytes, not a trained model."""
    import math

    from titan.checkpoint.format import seal, sha256_files, verify
    from titan.checkpoint.train_state import model_shapes
    from titan.config import load_config
    from titan.train.model import resolve_model

    resolved = resolve_model(load_config(recipe, ["--model.flavor", flavor, "--training.seq_len", "2048"]))
    spec, args = resolved.spec, resolved.args
    params = sum(math.prod(s) for s in model_shapes(spec, args).values())
    total = 12 * params
    chunk = os.urandom(64 * 2**20)
    with tempfile.TemporaryDirectory(prefix="titan-bench-verify-", dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
        names = [f"__{r}_0.distcp" for r in range(files)]
        for name in names:
            with open(Path(tmp, name), "wb") as f:
                left = total // files
                while left > 0:
                    left -= f.write(chunk[: min(left, len(chunk))])
        seal(Path(tmp), sha256_files(Path(tmp), names))
        start = time.perf_counter()
        problem = verify(Path(tmp))
        seconds = time.perf_counter() - start
    assert problem is None, problem
    print(f"{flavor}: {params / 1e9:.2f}B parameters, checkpoint {total / 1e9:.1f} GB in {files} files: "
          f"verified in {seconds:.1f} s by one process ({total / seconds / 1e9:.2f} GB/s, {os.cpu_count()} cores); "
          f"with N ranks each hashes 1/N of the files")  # fmt: skip


def straggler_figures(recipe: str, steps: int, overrides: list[str]) -> None:
    """FSDP2 on two ranks, each pinned to its own core with one thread, and a busy loop pinned to rank 1's
    core (rank 1 runs at about half speed): static even shares against straggler re-planning."""
    if (os.cpu_count() or 1) < 2:
        sys.exit("--compare straggler needs two CPU cores")
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=lambda: os.sched_setaffinity(0, {1}))
    try:
        results = {}
        for label, extra in (("static", []), ("re-planned", ["--straggler.enable", "true"])):
            with tempfile.TemporaryDirectory(prefix="titan-bench-") as out:
                common = [
                    *("--job.output_dir", out, "--job.name", "straggler", "--training.steps", str(steps)),
                    *("--lr_scheduler.warmup_steps", "0"),
                    *("--parallel.dp_shard", "2", "--metrics.log_freq", "1", "--metrics.wandb", "disabled"),
                    *("--metrics.tensorboard", "false", "--checkpoint.enable", "false", "--validation.interval", "0"),
                    *overrides,
                    *extra,
                ]
                env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(29500 + os.getpid() % 1000)}  # fmt: skip
                ranks = [
                    subprocess.Popen(
                        [sys.executable, "-m", "titan", "train", "--config", recipe, *common],
                        cwd=ROOT,
                        env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
                        text=True,
                        preexec_fn=lambda r=r: os.sched_setaffinity(0, {r}),
                    )
                    for r in range(2)
                ]
                stderr = ranks[0].communicate()[1]
                if any(p.wait() != 0 for p in ranks):
                    sys.exit(f"{label} run failed:\n{stderr[-4000:]}")
                metrics = Path(out) / "straggler" / "metrics.jsonl"
                records = [json.loads(line) for line in metrics.read_text().splitlines()]
            times = {r["step"]: r["step_time_s"] for r in records if "step_time_s" in r}
            replans = [r for r in records if r.get("replan")]
            results[label] = (times, replans)
    finally:
        hog.kill()
    static, _ = results["static"]
    print(f"{'run':<12}{'median step ms':>16}{'after re-plan':>15}  re-plan")
    for label, (times, replans) in results.items():
        first = replans[0]["step"] if replans else None
        after = [t for s, t in times.items() if first is not None and s > first + 1]
        detail = "-"
        if replans:
            rows = [v for k, v in sorted(replans[0].items()) if k.startswith("dp_rows_")]
            elapsed = sum(t for s, t in times.items() if s <= first)
            detail = f"at step {first} ({elapsed:.1f} s in), rows per rank {rows}, {len(replans)} re-plan(s)"
        median_after = f"{1000 * statistics.median(after):.0f}" if after else "-"
        print(f"{label:<12}{1000 * statistics.median(times.values()):>16.0f}{median_after:>15}  {detail}")


# scripts/gpu_check.sh's benchmark: Llama 3 8B's layers (dim 4096, GQA 32/8, vocab 128,256), cut to --layers, at
# seq 8,192 in bf16 on one GPU, with its real data and tokenizer swapped for the project's own.
GPU_RECIPE = ROOT / "recipes" / "llama3_8b.toml"
GPU_SHAPE = [
    *("--training.seq_len", "8192", "--training.local_batch_size", "1", "--training.global_batch_size", "1"),
    *("--parallel.dp_shard", "1", "--validation.interval", "0", "--data.source", str(ROOT / "data" / "stories.jsonl")),
    *("--tokenizer.path", str(ROOT / "data" / "tokenizer.json")),
]
# --dry-run: the same runs on the CPU, on a model small enough for a few steps there.
DRY_SHAPE = [
    *("--training.device", "cpu", "--training.seq_len", "256", "--model.overrides.dim", "256"),
    *("--model.overrides.n_heads", "4", "--model.overrides.n_kv_heads", "2", "--model.overrides.vocab_size", "2048"),
    *("--model.overrides.multiple_of", "256", "--model.overrides.max_seq_len", "256"),
]
# id -> overrides: eager and compiled bf16, each checkpointing mode, and Float8 (compiled, as torchao intends it).
GPU_RUNS = {
    "eager": ["--activation_checkpoint.mode", "none"],
    "eager_selective_ac": ["--activation_checkpoint.mode", "selective"],
    "eager_full_ac": ["--activation_checkpoint.mode", "full"],
    "compiled": ["--activation_checkpoint.mode", "none", "--compile.enable", "true"],
    "float8_compiled": ["--activation_checkpoint.mode", "none", "--compile.enable", "true", "--float8.enable", "true"],
}


def expert_figures(repeats: int = 3) -> None:
    """Forward and backward of one layer's routed experts, titan's grouped matmul against a Python loop over the
    experts, on the debug MoE's shapes and a Qwen3-30B-A3B layer's (fewer tokens on a CPU)."""
    import torch

    from titan.models.moe import FLAVORS
    from titan.models.moe.experts import GroupedExperts

    def loop(experts, x, counts):
        pieces = x.split(counts.tolist())
        return torch.cat([
            (torch.nn.functional.silu(p @ w1.T) * (p @ w3.T)) @ w2.T
            for p, w1, w2, w3 in zip(pieces, experts.w1, experts.w2, experts.w3)
        ])  # fmt: skip

    def seconds(fn, experts, x, counts) -> float:
        times = []
        for _ in range(repeats + 1):  # the first warms up
            start = time.perf_counter()
            fn(experts, x, counts).sum().backward()
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])

    print(f"{'shape':<16}{'experts':>8}{'top_k':>6}{'tokens':>8}{'grouped ms':>12}{'loop ms':>10}{'loop/grouped':>14}")
    for flavor, tokens in (("debug", 2048), ("qwen3_30b_a3b", 2048 if torch.cuda.is_available() else 512)):
        a = FLAVORS[flavor]
        torch.manual_seed(0)
        experts = GroupedExperts(a.dim, a.expert_hidden_dim, a.n_experts)
        for w in experts.parameters():
            torch.nn.init.normal_(w, std=0.02)
        chosen = torch.randint(0, a.n_experts, (tokens * a.top_k,))
        counts = torch.bincount(chosen, minlength=a.n_experts)
        x = torch.randn(tokens * a.top_k, a.dim, requires_grad=True)
        grouped = seconds(lambda e, x, c: e(x, c), experts, x, counts)
        looped = seconds(loop, experts, x, counts)
        print(f"{flavor:<16}{a.n_experts:>8}{a.top_k:>6}{tokens:>8}{1e3 * grouped:>12.1f}{1e3 * looped:>10.1f}"
              f"{looped / grouped:>14.2f}")  # fmt: skip


def gpu_figures(args, runs: list[str], overrides: list[str]) -> dict:
    """Each of `runs` (GPU_RUNS ids) trained in its own process: tokens/s, MFU and measured peak memory, next to
    `titan plan`'s peak for the same run. Returns the report (also written to --json)."""
    from titan.config import load_config
    from titan.train.estimate.estimate import estimate_step

    args.config = str(GPU_RECIPE)
    shape = [*GPU_SHAPE, "--model.overrides.n_layers", str(args.layers), *(DRY_SHAPE if args.dry_run else [])]
    rows = []
    for name in runs:
        run_overrides = [*shape, *GPU_RUNS[name], *overrides]
        result = run(name, "titan", 1, args, run_overrides)
        try:
            planned = estimate_step(load_config(GPU_RECIPE, run_overrides, world_size=1), 1).ranks[0].peak / 2**30
        except Exception as e:  # one run the planner cannot trace still leaves the others' figures
            planned, result["plan_error"] = None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        measured = result["peak_memory_gib"]
        rows.append({**result, "planned_peak_gib": planned,
                     "plan_vs_measured": planned / measured - 1 if planned and measured else None})  # fmt: skip
        print(f"{name}: {result['tokens_per_s']:,.0f} tokens/s, MFU {100 * result['mfu']:.1f}%, peak {measured:.2f} GiB"
              f" (planned {planned if planned is None else round(planned, 2)})", flush=True)  # fmt: skip
    goals = {} if args.dry_run else gpu_goals(rows)  # a dry run's figures say nothing about a GPU's
    shape = {"layers": args.layers, "dim": 256 if args.dry_run else 4096, "seq_len": 256 if args.dry_run else 8192}
    report = {**shape, "dry_run": args.dry_run, "steps": args.steps, "warmup": args.warmup, "overrides": overrides,
              "results": rows, "goals": goals}  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


def gpu_goals(rows: list[dict]) -> dict[str, bool]:
    """The issue's goals for one H100, each with whether the runs meet it."""
    by_name, goals = {r["run"]: r for r in rows}, {}
    if "compiled" in by_name:
        goals[f"bf16 compiled MFU {by_name['compiled']['mfu']:.1%} >= 45%"] = by_name["compiled"]["mfu"] >= 0.45
    if {"compiled", "float8_compiled"} <= set(by_name):
        speedup = by_name["float8_compiled"]["tokens_per_s"] / by_name["compiled"]["tokens_per_s"]
        goals[f"float8 / bf16 tokens/s = {speedup:.2f} >= 1.25"] = speedup >= 1.25
    errors = [abs(r["plan_vs_measured"]) for r in rows if r["plan_vs_measured"] is not None]
    if errors:
        goals[f"titan plan's peak within 10% of the measured (worst {max(errors):.1%})"] = max(errors) <= 0.10
    return goals


def comparison_runs(args, overrides: list[str]) -> tuple[list, list[str]]:
    """The runs of --compare (label, mode, processes, overrides) and the overrides all of them take."""
    runs = COMPARISONS[args.compare]
    if args.compare == "packing":
        corpus = long_tailed_corpus(Path(tempfile.mkdtemp(prefix="titan-bench-corpus-")) / "long_tailed.jsonl")
        overrides += [*PACKING_RECIPE, "--data.source", str(corpus)]
    if args.compare == "cp":
        overrides += CP_RECIPE
    if args.compare == "moe":  # a profile of the last 2 steps: their profiler hardly moves the median step time
        overrides += ["--profiling.enable", "true", "--profiling.wait", str(max(0, args.steps - 3))]
        overrides += ["--profiling.warmup", "1", "--profiling.active", "2"]
    if args.compare in ("layouts", "moe"):
        # The same global batch everywhere: each data-parallel rank takes its share.
        from titan.config import load_config

        t = load_config(args.config, overrides).training
        global_batch = t.global_batch_size or t.local_batch_size
        runs = [
            (label, mode, n, [*extra, "--training.global_batch_size", str(global_batch)])
            for label, mode, n, extra in runs
        ]
    return runs, overrides


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="the recipe (default recipes/debug.toml; debug_moe.toml for --compare moe)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--history",
        type=Path,
        default=ROOT / "outputs" / "bench" / "history.jsonl",
        help="every report is appended here, and each run's tokens/s compared with the last like it",
    )
    parser.add_argument("--compare", choices=sorted([*COMPARISONS, "straggler"]), default="bare")
    parser.add_argument("--init-flavors", help="comma-separated flavors: time their initialisation instead")
    parser.add_argument("--data", action="store_true", help="measure data preparation and loading instead")
    parser.add_argument("--verify-flavor", help="time the manifest check of a checkpoint of this flavor instead")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="with --data: tokenizer processes")
    parser.add_argument("--experts", action="store_true", help="grouped expert matmuls vs a loop over experts")
    parser.add_argument("--gpu", action="store_true", help="the 8B-shaped runs of scripts/gpu_check.sh instead")
    parser.add_argument("--layers", type=int, default=4, help="with --gpu: the 8B model's layers to keep")
    parser.add_argument("--runs", default=",".join(GPU_RUNS), help="with --gpu: which runs, comma-separated")
    parser.add_argument("--dry-run", action="store_true", help="with --gpu: tiny shapes on the CPU")
    parser.add_argument("--_mode", choices=["titan", "bare"], help=argparse.SUPPRESS)
    parser.add_argument("--_out", help=argparse.SUPPRESS)
    args, overrides = parser.parse_known_args()
    args.config = args.config or str(ROOT / "recipes" / ("debug_moe.toml" if args.compare == "moe" else "debug.toml"))
    if args._mode:  # a child process: each rank writes its result
        result = measure(args._mode, args.config, args.steps, args.warmup, overrides)
        Path(args._out, f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(result))
        return
    standalone = {  # the modes that measure something else than training runs
        "init_flavors": lambda: init_times(args.init_flavors.split(","), args.config),
        "data": lambda: data_figures(args.config, overrides, args.workers),
        "verify_flavor": lambda: verify_figures(args.verify_flavor, args.config),
        "experts": expert_figures,
    }
    for flag, figures in standalone.items():
        if getattr(args, flag):
            figures()
            return
    if args.gpu:
        unknown = sorted(set(args.runs.split(",")) - set(GPU_RUNS))
        if unknown:
            sys.exit(f"--runs: unknown {unknown}; known: {', '.join(GPU_RUNS)}")
        gpu_figures(args, args.runs.split(","), overrides)
        return
    if args.compare == "straggler":
        straggler_figures(args.config, args.steps, overrides)
        return

    import torch

    from titan.config import load_config
    from titan.observe.metrics import peak_flops

    share: dict[int, list[str]] = {}  # processes -> the peak override each run gets
    if not any(o.startswith("--metrics.peak_flops") for o in overrides) and not torch.cuda.is_available():
        bf16 = load_config(args.config, overrides).training.mixed_precision == "bf16"
        rate, what = peak_flops(torch.device("cpu"), dtype=torch.bfloat16 if bf16 else torch.float32)
        print(f"MFU against {what}; each of n ranks on these cores against 1/n of it.")
        share = {n: ["--metrics.peak_flops", f"{rate / n:.4e}"] for n in range(1, 9)}
    runs, overrides = comparison_runs(args, overrides)
    results = [run(label, mode, n, args, [*overrides, *extra, *share.get(n, [])]) for label, mode, n, extra in runs]
    base = results[0]
    print(
        f"{'run':<12}{'procs':>6}{'step ms':>10}{'tokens/s':>12}{'MFU':>8}  "
        f"{'peak GiB per rank':<22}{'ckpt block ms':>14}"
    )
    for r in results:
        r["step_time_vs_first"] = r["step_time_ms"] / base["step_time_ms"]
        memory = " ".join(f"{m:.2f}" for m in r["peak_memory_gib_per_rank"])
        blocked = f"{r['checkpoint_blocked_ms']:.0f}" if r["checkpoint_blocked_ms"] is not None else "-"
        print(
            f"{r['run']:<12}{r['world_size']:>6}{r['step_time_ms']:>10.1f}{r['tokens_per_s']:>12,.0f}"
            f"{100 * r['mfu']:>7.2f}%  {memory:<22}{blocked:>14}"
        )
    for r in results[1:]:
        print(f"{r['run']} step time / {base['run']} step time = {r['step_time_vs_first']:.3f}")
    if args.compare == "moe":
        print("where rank 0's profiled steps go: " + ", ".join(MOE_PARTS) + " (router: forward only)")
        for r in results:
            print(f"{r['run']:<12}" + "".join(f"{part} {share:6.1%}  " for part, share in r["step_shares"].items()))
    report = {
        "recipe": args.config,
        "compare": args.compare,
        "steps": args.steps,
        "warmup": args.warmup,
        "overrides": overrides,
        "device": base["device"],
        "results": results,
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    keep_in_history(report, args.history)


def keep_in_history(report: dict, path: Path) -> None:
    """Append the report, dated and with the commit, to the history file, and print how tokens/s moved since the
    last report of the same comparison (same recipe, overrides and machine)."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "commit": commit.stdout.strip() or None,
        "machine": f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}",
        **report,
    }
    key = ("recipe", "compare", "overrides", "steps", "machine")
    earlier = []
    if path.exists():
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        earlier = [r for r in records if all(r.get(k) == report[k] for k in key)]
    if earlier:
        last = {r["run"]: r for r in earlier[-1]["results"]}
        moves = [
            f"{r['run']} {r['tokens_per_s'] / last[r['run']]['tokens_per_s']:.3f}x"
            for r in report["results"]
            if r["run"] in last
        ]
        print(f"tokens/s against {earlier[-1]['date']} ({earlier[-1]['commit']}): {', '.join(moves)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(report) + "\n")
    print(f"kept in {path}")


if __name__ == "__main__":
    main()
