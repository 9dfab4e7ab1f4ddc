"""The MoE family's sizes. Each uses Llama's grouped-query attention with RoPE (titan/models/decoder/attention.py);
none uses DeepSeek's multi-head latent attention."""

from titan.models.moe.args import MoEArgs

FLAVORS: dict[str, MoEArgs] = {
    # Tiny, for laptops and tests, with the dense debug Llama's attention, and its active feed-forward width per token
    # (704): two routed experts of 176 and two shared ones. The first layer stays dense, as DeepSeek-V3's first do.
    "debug": MoEArgs(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_dim=32,
        qk_norm=False,
        vocab_size=2048,
        norm_eps=1e-5,
        rope_theta=10000.0,
        max_seq_len=2048,
        dense_layers=1,
        dense_hidden_dim=704,
        n_experts=8,
        top_k=2,
        expert_hidden_dim=176,
        n_shared_experts=2,
        score_func="softmax",
        norm_topk=True,
        bias_update_rate=0.001,
        aux_loss_coef=0.0001,
    ),
    # Qwen3-30B-A3B (3.3B active): 48 layers of 128 experts, 8 per token, no shared expert, q/k norms, GQA 32/4
    # with 128-wide heads; balanced by the bias rather than Qwen's global-batch auxiliary loss.
    "qwen3_30b_a3b": MoEArgs(
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        head_dim=128,
        qk_norm=True,
        vocab_size=151936,
        norm_eps=1e-6,
        rope_theta=1000000.0,
        max_seq_len=40960,
        n_experts=128,
        top_k=8,
        expert_hidden_dim=768,
        score_func="softmax",
        norm_topk=True,
    ),
    # DeepSeek-V3's routing at DeepSeek-V2-Lite's 16B size (2.4B active): the first layer dense, 64 routed experts,
    # 6 per token, 2 shared; sigmoid scores normalised over the chosen and scaled by V3's 2.5, chosen within the 4
    # best of 8 groups; the bias and a small sequence-level loss.
    # Attention is Llama's multi-head attention (16 heads of 128) in place of DeepSeek's MLA.
    "deepseek_v3_16b": MoEArgs(
        dim=2048,
        n_layers=27,
        n_heads=16,
        n_kv_heads=16,
        head_dim=128,
        qk_norm=False,
        vocab_size=102400,
        norm_eps=1e-6,
        rope_theta=10000.0,
        max_seq_len=4096,
        dense_layers=1,
        dense_hidden_dim=10944,
        n_experts=64,
        top_k=6,
        expert_hidden_dim=1408,
        n_shared_experts=2,
        score_func="sigmoid",
        norm_topk=True,
        route_scale=2.5,
        n_group=8,
        topk_group=4,
        aux_loss_coef=0.0001,
    ),
}
