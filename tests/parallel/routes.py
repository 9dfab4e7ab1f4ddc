"""`titan train` recording each router's choices: the CLI's own entry point with the arguments given, started as
`python tests/parallel/routes.py train ...`, alone or under torchrun. Every rank saves to $TITAN_ROUTES/rank<r>.pt,
for each training forward of a router (not a recomputation, nor evaluation): the step, the layer, the global rows
and the positions its tokens hold, and each token's experts. Under tensor parallelism a router sees its tp rank's
share of the positions (Shard(1), tp innermost in the mesh). Global module hooks see every model part and router
whatever wraps them, and the optimizer hook counts the steps: nothing of titan is patched."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from titan.cli import main
from titan.models.decoder.model import Decoder
from titan.models.moe.routing import Router, counting


class Routes:
    def __init__(self):
        self.step, self.rows, self.positions, self.layers, self.records = 0, None, None, {}, []

    def part(self, module: nn.Module, args: tuple) -> None:
        """A model or pipeline stage starts a micro-batch: its inputs are (tokens or hidden states, rows, ...)."""
        if isinstance(module, Decoder) and len(args) > 1:
            self.rows = args[1].cpu().clone()  # a pipeline stage receives them into a reused buffer
            ring = module.context_parallel
            # The positions of each row this rank holds: the ring's, or the whole row's (the input's length).
            self.positions = torch.arange(args[0].shape[1]) if ring is None else ring.positions.cpu()
            self.layers = {id(m): name.split(".")[1] for name, m in module.named_modules() if isinstance(m, Router)}

    def route(self, module: nn.Module, args: tuple, output) -> None:
        if isinstance(module, Router) and counting():
            experts = output[1].cpu()
            positions, shards = self.positions, len(self.positions) * len(self.rows) // len(experts)
            if shards > 1:  # tensor parallelism: this tp rank's chunk of each row's positions
                positions = positions.chunk(shards)[int(os.environ.get("RANK", "0")) % shards]
            self.records.append((self.step, self.layers[id(module)], self.rows, positions, experts))

    def stepped(self, *_) -> None:
        self.step += 1


if __name__ == "__main__":
    routes = Routes()
    nn.modules.module.register_module_forward_pre_hook(routes.part)
    nn.modules.module.register_module_forward_hook(routes.route)
    register_optimizer_step_post_hook(routes.stepped)
    try:
        main()
    finally:
        folder = Path(os.environ["TITAN_ROUTES"])
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(routes.records, folder / f"rank{os.environ.get('RANK', '0')}.pt")
