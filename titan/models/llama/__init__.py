from titan.models.decoder.args import kv_width
from titan.models.llama.args import ModelArgs
from titan.models.llama.flavors import FLAVORS

__all__ = ["FLAVORS", "ModelArgs", "Transformer", "flops_per_token", "kv_width"]


def __getattr__(name: str):
    """The modules (and torch with them) load on first use: a recipe's flavor and overrides are checked first."""
    if name == "Transformer":
        from titan.models.llama.model import Transformer

        return Transformer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6 per matmul weight (forward 2, backward 4), plus 12 * layers * dim * seq_len
    for attention scores and values, as in the PaLM paper's MFU. Embedding lookups are not matmuls."""
    hd = args.head_dim
    attention = args.dim * hd * (2 * args.n_heads + 2 * args.n_kv_heads)
    ffn = 3 * args.dim * args.ffn_hidden_dim
    matmul_weights = args.n_layers * (attention + ffn) + args.dim * args.vocab_size
    return 6 * matmul_weights + 12 * args.n_layers * args.dim * seq_len
