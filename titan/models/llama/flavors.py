"""Every Llama 3 size in one place. The published sizes use Meta's hyper-parameters."""

from titan.models.llama.args import ModelArgs

FLAVORS: dict[str, ModelArgs] = {
    # Tiny, for laptops and tests: a step takes well under a second on a CPU. Vocabulary of the project's tokenizer.
    "debug": ModelArgs(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        vocab_size=2048,
        multiple_of=64,
        ffn_dim_multiplier=None,
        rope_theta=10000.0,
        rope_scaling_factor=0.0,
        max_seq_len=2048,
    ),
    # Llama 3.2 1B and 3B: tied embeddings, RoPE scaled by 32.
    "1B": ModelArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        multiple_of=256,
        ffn_dim_multiplier=1.5,
        rope_scaling_factor=32.0,
        tie_embeddings=True,
        max_seq_len=131072,
    ),
    "3B": ModelArgs(
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        multiple_of=256,
        ffn_dim_multiplier=1.0,
        rope_scaling_factor=32.0,
        tie_embeddings=True,
        max_seq_len=131072,
    ),
    # Llama 3.1 8B, 70B and 405B.
    "8B": ModelArgs(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, multiple_of=1024, ffn_dim_multiplier=1.3, max_seq_len=131072
    ),
    "70B": ModelArgs(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, multiple_of=4096, ffn_dim_multiplier=1.3, max_seq_len=131072
    ),
    "405B": ModelArgs(
        dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, multiple_of=4096, ffn_dim_multiplier=1.2, max_seq_len=131072
    ),
}
