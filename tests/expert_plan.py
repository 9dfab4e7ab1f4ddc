"""What the planner's tests of expert parallelism share: the debug MoE recipe, and the all-to-all bytes a step
moves, by hand."""

from conftest import ROOT
from titan.config import Layout
from titan.train.model import resolve_model

MOE_RECIPE = ROOT / "recipes" / "debug_moe.toml"


def all_to_all_by_hand(config, world: int, recomputing: int) -> int:
    """Expert parallelism's all-to-all bytes per step of a rank, by hand (docs/planning.md): per MoE layer and
    micro-batch, the dispatch and the combine forward, their mirrors backward and, in a block that recomputes
    (`recomputing` of them), its forward's again, each carrying the f T k / ep rows the most loaded rank receives
    from each of the ep - 1 others (f the load imbalance, T the rank's tokens: its share of each row's positions
    over cp and, in the MoE layers, over tp; top k) of dim x bytes (bf16 under FSDP's mixed precision); and once
    per forward the experts' token counts (int64, an even share each)."""
    layout, t = Layout.from_config(config.parallel, world), config.training
    if layout.ep == 1:
        return 0
    args = resolve_model(config).args
    micro_batches = t.global_batch_size // (layout.dp * t.local_batch_size)
    row = args.dim * (2 if t.mixed_precision == "bf16" else 4)
    pairs = t.local_batch_size * t.seq_len // (layout.cp * layout.tp) * args.top_k
    received = round(config.plan.moe_load_imbalance * pairs / layout.ep) * (layout.ep - 1)
    moe = len(args.moe_layers)
    tokens = (4 * moe + 2 * recomputing) * received * row
    counts = (moe + recomputing) * args.n_experts // layout.ep * (layout.ep - 1) * 8
    return micro_batches * (tokens + counts)
