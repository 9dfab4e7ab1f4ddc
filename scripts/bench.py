"""Benchmark a recipe: titan's trainer against a bare PyTorch loop on the same model and batch.

    python scripts/bench.py --config recipes/debug.toml --steps 30 [--section.key value ...]
    python scripts/bench.py --config recipes/debug.toml --compare float8 [--training.mixed_precision bf16 ...]

Each measurement runs in its own process, so peak memory is its own. Step time is the median over the
steps after warm-up; the bare loop (same model and init, one fixed batch, plain AdamW, no data loading,
logging or clipping) shows what the framework costs on top of the math. `--compare float8` runs titan's
trainer twice instead, with float8.enable false and true (the [float8] section's other keys apply).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def measure(mode: str, recipe: str, steps: int, warmup: int, overrides: list[str]) -> dict:
    import tempfile

    import torch
    import torch.nn.functional as F

    from titan.config import gradient_accumulation_steps, load_config
    from titan.data import Tokenizer, build_loader
    from titan.metrics import peak_flops, peak_memory_bytes
    from titan.trainer import Trainer, build_model, pick_device, resolve_model

    overrides = ["--training.steps", str(steps), "--metrics.wandb", "disabled", "--metrics.tensorboard", "false",
                 "--metrics.log_freq", str(steps), "--job.output_dir", tempfile.mkdtemp(prefix="titan-bench-"), *overrides]
    config = load_config(recipe, overrides)
    if mode == "titan":
        trainer = Trainer(config)
        trainer.train()
        times, device = trainer.step_times, trainer.device
    else:
        device = pick_device(config.training.device)
        model = build_model(config, device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.optimizer.lr)
        inputs, labels = (t.to(device) for t in next(build_loader(config, Tokenizer(config.tokenizer))))
        bf16 = config.training.mixed_precision == "bf16"
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            for _ in range(gradient_accumulation_steps(config, 1)):
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                    logits = model(inputs)
                F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
    spec, model_args = resolve_model(config)
    t = config.training
    tokens_per_step = t.local_batch_size * t.seq_len * gradient_accumulation_steps(config, 1)
    step_time = statistics.median(times[warmup:])
    tokens_per_s = tokens_per_step / step_time
    mfu = tokens_per_s * spec.flops_per_token(model_args, t.seq_len) / peak_flops(device, config.metrics.peak_flops)
    return {
        "mode": mode,
        "step_time_ms": 1000 * step_time,
        "tokens_per_s": tokens_per_s,
        "mfu": mfu,
        "peak_memory_gib": peak_memory_bytes(device) / 2**30,
        "device": str(device),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "recipes" / "debug.toml"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--compare", choices=["float8"], help="titan without and with float8.enable, instead of bare vs titan")
    parser.add_argument("--_mode", choices=["titan", "bare"], help=argparse.SUPPRESS)
    args, overrides = parser.parse_known_args()
    if args._mode:  # a child process: print one JSON result
        print(json.dumps(measure(args._mode, args.config, args.steps, args.warmup, overrides)))
        return

    if not any(o.startswith("--metrics.peak_flops") for o in overrides):
        # Measure the CPU once, so both runs' MFU use the same denominator.
        import torch

        from titan.metrics import measure_cpu_flops

        if not torch.cuda.is_available():
            overrides += ["--metrics.peak_flops", f"{measure_cpu_flops():.4e}"]
    runs = [("bare", "bare", []), ("titan", "titan", [])]  # (label, mode, extra overrides)
    if args.compare == "float8":
        runs = [("titan", "titan", ["--float8.enable", "false"]), ("float8", "titan", ["--float8.enable", "true"])]
    results = []
    for label, mode, extra in runs:
        cmd = [sys.executable, __file__, "--_mode", mode, "--config", args.config, "--steps", str(args.steps),
               "--warmup", str(args.warmup), *overrides, *extra]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=os.environ)
        if out.returncode != 0:
            sys.exit(f"{label} run failed:\n{out.stderr}")
        results.append({**json.loads(out.stdout.strip().splitlines()[-1]), "mode": label})
    base, other = results
    other[f"step_time_vs_{base['mode']}"] = other["step_time_ms"] / base["step_time_ms"]
    if not args.compare:
        other["overhead_vs_bare"] = other["step_time_vs_bare"]
    print(f"{'run':<8}{'step ms':>10}{'tokens/s':>12}{'MFU':>8}{'peak GiB':>10}  device")
    for r in results:
        print(f"{r['mode']:<8}{r['step_time_ms']:>10.1f}{r['tokens_per_s']:>12,.0f}{100 * r['mfu']:>7.2f}%{r['peak_memory_gib']:>10.2f}  {r['device']}")
    print(f"{other['mode']} step time / {base['mode']} step time = {other['step_time_ms'] / base['step_time_ms']:.3f}")
    report = {"recipe": args.config, "steps": args.steps, "warmup": args.warmup, "overrides": overrides, "results": results}
    print(json.dumps(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
