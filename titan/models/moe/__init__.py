import dataclasses
from collections.abc import Sequence

from titan.models.contract import RoutedExperts
from titan.models.decoder.args import kv_width
from titan.models.moe.args import MoEArgs
from titan.models.moe.flavors import FLAVORS

__all__ = [
    "FLAVORS",
    "MoEArgs",
    "MoETransformer",
    "active_params",
    "flops_per_token",
    "kv_width",
    "layers_args",
    "routed_experts",
]


def __getattr__(name: str):
    """The modules (and torch with them) load on first use: a recipe's flavor and overrides are checked first."""
    if name == "MoETransformer":
        from titan.models.moe.model import MoETransformer

        return MoETransformer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def active_params(args: MoEArgs) -> int:
    """Matmul weights one token goes through: attention, its layer's dense SwiGLU or router, top_k routed and the
    shared experts, and the output head."""
    attention = args.dim * args.head_dim * (2 * args.n_heads + 2 * args.n_kv_heads)
    dense = 3 * args.dim * args.dense_hidden_dim
    experts = args.top_k + args.n_shared_experts
    moe = args.dim * args.n_experts + 3 * args.dim * args.expert_hidden_dim * experts
    layers = args.dense_layers * (attention + dense) + len(args.moe_layers) * (attention + moe)
    return layers + args.dim * args.vocab_size


def flops_per_token(args: MoEArgs, seq_len: int) -> float:
    """Training FLOPs per token, as Llama's (titan/models/llama/__init__.py) but counting only the active weights."""
    return 6 * active_params(args) + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len


def routed_experts(args: MoEArgs) -> RoutedExperts:
    """What expert parallelism sends: each token's hidden state (dim) to each of its top_k experts."""
    return RoutedExperts(
        width=args.dim, top_k=args.top_k, n_experts=args.n_experts, expert_layers=tuple(args.moe_layers)
    )


def layers_args(args: MoEArgs, layer_ids: Sequence[int]) -> MoEArgs:
    """The args of a model whose blocks are built as `layer_ids`' are: their dense ones, then their routed ones."""
    routed = [layer in args.moe_layers for layer in layer_ids]
    if routed != sorted(routed):
        raise ValueError(f"layers {list(layer_ids)}: a MoE model's dense layers come before its routed ones")
    return dataclasses.replace(args, n_layers=len(routed), dense_layers=routed.count(False))
