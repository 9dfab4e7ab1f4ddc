"""How much of context parallelism's ring communication hides behind attention compute.

    torchrun --nproc-per-node 2 scripts/ring_profile.py [--config recipes/debug.toml] [--seq 4096] [--section.key value]

Trains the recipe with parallel.cp = the world size, one row of --seq tokens a step, and counts on each rank
every block of keys and values (or of their gradients) that the ring sends and how long the rank then waits for
the one it receives. A wait has two causes: the transfer itself, or a rank that is behind (uneven work, or a core
taken by something else). Every rank waits at the same point only for the first, so the exposed communication is
the sum over the ring's waits of the shortest rank's wait, and the rest is imbalance. After training, the same
exchanges run one after another with nothing to overlap them: the whole communication, of which the share hidden
is 1 - exposed / whole.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from titan.config import load_config
from titan.parallel import cp
from titan.train.trainer import Trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="recipes/debug.toml")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    args, overrides = parser.parse_known_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world < 2:
        parser.error("run it under torchrun with 2 or more processes: the ring needs a cp group")
    seq = str(args.seq)
    config = load_config(
        args.config,
        [
            *("--parallel.cp", str(world), "--parallel.dp_shard", "1"),
            *("--training.seq_len", seq, "--model.overrides.max_seq_len", seq),
            *("--training.local_batch_size", "1", "--training.global_batch_size", "1"),
            *("--training.steps", str(args.warmup + args.steps), "--checkpoint.enable", "false"),
            *("--validation.interval", "0", "--job.name", "ring_profile"),
            *overrides,
        ],
        world_size=world,
    )
    trainer = Trainer(config)
    trainer.train(until=args.warmup)

    sent: list[tuple[cp.ContextParallel, int, torch.dtype, int]] = []  # (ring, elements, dtype, tag) per exchange
    waits: list[float] = []  # seconds, per wait in the ring's order (the same on every rank)
    exchange, wait = cp.ContextParallel.exchange, cp._wait

    def counted_exchange(ring, send, tag):
        sent.append((ring, send.numel(), send.dtype, tag))
        return exchange(ring, send, tag)

    def timed_wait(works):
        start = time.perf_counter()
        wait(works)
        waits.append(time.perf_counter() - start)

    cp.ContextParallel.exchange, cp._wait = counted_exchange, timed_wait
    start = time.perf_counter()
    trainer.train(until=args.warmup + args.steps)
    step = (time.perf_counter() - start) / args.steps
    cp.ContextParallel.exchange, cp._wait = exchange, wait

    # The same exchanges, one after another, with nothing to overlap them.
    dist.barrier()
    start = time.perf_counter()
    for ring, elements, dtype, tag in sent:
        _, works = ring.exchange(torch.empty(elements, dtype=dtype), tag)
        wait(works)
    whole = (time.perf_counter() - start) / args.steps
    sent_bytes = sum(n * torch.empty((), dtype=d).element_size() for _, n, d, _ in sent) / args.steps
    every = torch.tensor(waits)
    shortest, longest = every.clone(), every.clone()
    dist.all_reduce(shortest, op=dist.ReduceOp.MIN)
    dist.all_reduce(longest, op=dist.ReduceOp.MAX)
    figures = torch.tensor([step, whole])
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        step, whole = figures.tolist()
        exposed = shortest.sum().item() / args.steps
        behind = (longest - shortest).sum().item() / args.steps
        print(f"cp {world}, seq {args.seq}, {len(sent) // args.steps} exchanges a step ({sent_bytes / 2**20:.1f} MiB "
              "sent per rank); seconds per step, the slowest rank's:")  # fmt: skip
        print("| step | communication alone | exposed | hidden behind compute | waiting for a rank behind |")
        print("|---:|---:|---:|---:|---:|")
        print(f"| {step:.3f} | {whole:.3f} | {exposed:.3f} | {max(0.0, 1 - exposed / whole):.0%} | {behind:.3f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
