"""Qwen3's dense sizes: a debug one that trains on a laptop in seconds, and Qwen3-8B's published config."""

from titan.models.qwen3.args import Qwen3Args

FLAVORS = {
    "debug": Qwen3Args(
        dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=48, hidden_dim=512, vocab_size=2048, max_seq_len=2048
    ),
    # Qwen/Qwen3-8B's config.json; its embedding and head are not tied.
    "qwen3_8b": Qwen3Args(),
}
