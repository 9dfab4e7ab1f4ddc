from titan.models.decoder.args import kv_width
from titan.models.qwen3.args import Qwen3Args
from titan.models.qwen3.flavors import FLAVORS

__all__ = ["FLAVORS", "Qwen3", "Qwen3Args", "flops_per_token", "kv_width"]


def __getattr__(name: str):
    """The modules (and torch with them) load on first use: a recipe's flavor and overrides are checked first."""
    if name == "Qwen3":
        from titan.models.qwen3.model import Qwen3

        return Qwen3
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def flops_per_token(args: Qwen3Args, seq_len: int) -> float:
    """Training FLOPs per token, as Llama's (titan/models/llama/__init__.py): 6 per matmul weight, and attention's
    scores and values."""
    attention = args.dim * args.head_dim * (2 * args.n_heads + 2 * args.n_kv_heads)
    matmul_weights = args.n_layers * (attention + 3 * args.dim * args.hidden_dim) + args.dim * args.vocab_size
    return 6 * matmul_weights + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
