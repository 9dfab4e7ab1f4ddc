import dataclasses
from collections.abc import Sequence

from titan.models.contract import RoutedExperts
from titan.models.decoder import args as decoder_args
from titan.models.moe.args import MoEArgs
from titan.models.moe.flavors import FLAVORS

__all__ = [
    "FLAVORS",
    "MoEArgs",
    "MoETransformer",
    "active_params",
    "hf_format",
    "hf_format_blockers",
    "flops_per_token",
    "kv_width",
    "layers_args",
    "routed_experts",
    "training_blockers",
]


def __getattr__(name: str):
    """The modules (and torch with them) load on first use: a recipe's flavor and overrides are checked first."""
    if name == "MoETransformer":
        from titan.models.moe.model import MoETransformer

        return MoETransformer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def kv_width(args: MoEArgs) -> int:
    """One token's keys (or values) in one layer, as the context-parallel ring carries them: latent attention's are
    every head's, its values padded to the keys' width (titan/parallel/cp/ring.py)."""
    return args.n_heads * max(args.score_widths) if args.kv_lora_rank else decoder_args.kv_width(args)


def active_params(args: MoEArgs) -> int:
    """Matmul weights one token goes through in training: attention, its layer's dense SwiGLU or router, top_k routed
    and the shared experts, and the output head; and in each multi-token prediction module, the projection of its
    two norms, its MoE block (among the MoE layers) and the shared head again."""
    attention = args.attention_matmuls()
    dense = 3 * args.dim * args.dense_hidden_dim
    experts = args.top_k + args.n_shared_experts
    moe = args.dim * args.n_experts + 3 * args.dim * args.expert_hidden_dim * experts
    layers = args.dense_layers * (attention + dense) + len(args.moe_layers) * (attention + moe)
    return layers + (1 + args.mtp_layers) * args.dim * args.vocab_size + args.mtp_layers * 2 * args.dim * args.dim


def flops_per_token(args: MoEArgs, seq_len: int) -> float:
    """Training FLOPs per token, as Llama's (titan/models/llama/__init__.py) but counting only the active weights,
    and the attention of the multi-token prediction's blocks too."""
    qk, v = args.score_widths
    blocks = args.n_layers + args.mtp_layers
    return 6 * active_params(args) + 6 * blocks * args.n_heads * (qk + v) * seq_len


def hf_format(args: MoEArgs) -> str:
    """The Hugging Face format these args export to: DeepSeek-V3's with latent attention, Qwen3-MoE's without."""
    return "deepseek_v3" if args.kv_lora_rank else "qwen3_moe"


def hf_format_blockers(args: MoEArgs) -> list[str]:
    """Each of these args that their HF format (`hf_format`) has no place for (none: the weights export)."""
    if hf_format(args) == "deepseek_v3":
        blockers = {
            f"score_func = {args.score_func!r}: DeepSeek-V3 scores experts by sigmoid": args.score_func != "sigmoid",
            "n_shared_experts = 0: DeepSeek-V3 has shared experts in every MoE layer": not args.n_shared_experts,
        }
    else:
        blockers = {
            "qk_norm = false: Qwen3-MoE normalises every head's queries and keys": not args.qk_norm,
            f"n_shared_experts = {args.n_shared_experts}: Qwen3-MoE has no shared experts": args.n_shared_experts,
            f"score_func = {args.score_func!r}: Qwen3-MoE scores experts by softmax": args.score_func != "softmax",
            f"route_scale = {args.route_scale}: Qwen3-MoE does not scale the routing weights": args.route_scale != 1,
            f"n_group = {args.n_group}: Qwen3-MoE chooses among all its experts": args.n_group != 1,
            f"mtp_layers = {args.mtp_layers}: Qwen3-MoE has no multi-token prediction modules": args.mtp_layers,
        }
    return [blocker for blocker, blocks in blockers.items() if blocks]


def training_blockers(args: MoEArgs) -> list[str]:
    """What a run of these args trains that no export holds: the format's blockers, and, for Qwen3-MoE, routing
    biases that move (it routes without them; DeepSeek-V3's files hold them), said at start-up rather than at
    export."""
    moving = hf_format(args) == "qwen3_moe" and args.bias_update_rate
    bias = [f"bias_update_rate = {args.bias_update_rate}: the routing biases move, and Qwen3-MoE has none (set it "
            "to 0 and balance with aux_loss_coef)"] if moving else []  # fmt: skip
    return hf_format_blockers(args) + bias


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
