"""What one transformer block keeps for backward under each activation checkpointing mode: `titan plan`'s figure
(traced under fake tensors) against a real block run on this CPU (every allocation its forward leaves live,
counted by titan.parallel.ac.kept_bytes, the measurement that activation_checkpoint.mode = "auto" trusts).

    python scripts/activation_bytes.py --config recipes/llama3_8b.toml --seq 8192

The block runs as on the recipe's ranks (bf16 parameters under FSDP's mixed precision, or autocast without FSDP),
at `--rows` sequences of `--seq` tokens; selective checkpointing keeps the CPU's flash attention output wherever a
GPU's would be kept. An 8B block at seq 8,192 needs about 12 GB of memory and a few minutes on two cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from titan.config import Layout, degrees_world_size, load_config, read_config
from titan.parallel import ac
from titan.train.estimate.estimate import estimate_step
from titan.train.model import resolve_model

MODES = {"none": ac.KEEP, "selective": ac.SELECTIVE, "full": ac.FULL}  # the recipe's mode: the block's way


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="recipes/llama3_8b.toml")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--rows", type=int, default=1, help="sequences per micro-batch")
    args = parser.parse_args()
    config = read_config(args.config, ["--training.seq_len", str(args.seq)])
    world = degrees_world_size(config.parallel)
    layout = Layout.from_config(config.parallel, world)
    if layout.tp > 1:
        parser.error(f"{args.config} splits its blocks by tensor parallel; the measurement runs a whole block")
    batch = ["--training.local_batch_size", str(args.rows), "--training.global_batch_size", str(args.rows * layout.dp)]
    config = load_config(args.config, ["--training.seq_len", str(args.seq), *batch], world_size=world)
    planned = estimate_step(config, world).block_activations  # every mode's, whatever the recipe's
    ckpt = config.activation_checkpoint
    save_ops = [*ckpt.save_ops, "aten._scaled_dot_product_flash_attention_for_cpu"]
    measured_config = dataclasses.replace(config, activation_checkpoint=dataclasses.replace(ckpt, save_ops=save_ops))
    resolved = resolve_model(config)
    spec, model_args = resolved.spec, resolved.args
    with torch.device("meta"):
        model = spec.build(model_args)
    start = time.perf_counter()
    measured = ac.kept_bytes(model, spec, measured_config, layout, args.rows, torch.device("cpu"), MODES.values())
    seconds = time.perf_counter() - start
    print(
        f"{config.model.name} {config.model.flavor}, one block, {args.rows} x {args.seq} tokens, "
        f"{config.training.mixed_precision} ({'FSDP' if layout.dp_shard > 1 else 'one device'}); measured in "
        f"{seconds:.0f} s on this CPU\n"
    )
    print("| mode | planned (MiB) | measured (MiB) | planned / measured |")
    print("|---|---:|---:|---:|")
    for mode, way in MODES.items():
        mib = planned[mode] / 2**20, measured[way] / 2**20
        print(f"| {mode} | {mib[0]:,.1f} | {mib[1]:,.1f} | {planned[mode] / measured[way]:.3f} |")


if __name__ == "__main__":
    main()
