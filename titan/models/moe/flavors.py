"""The MoE family's sizes: Qwen3-MoE's and a DeepSeek-V3-routed one on grouped-query attention with RoPE
(titan/models/decoder/attention.py), and DeepSeek-V3's and Kimi K2's on multi-head latent attention
(titan/models/decoder/latent_attention.py), with a debug size of the latter."""

import dataclasses

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
    # DeepSeek-V3 in miniature, for laptops and tests: latent attention (a query latent, keys and values from a
    # latent of 64), sigmoid routing within the best 2 of 4 groups scaled by 2.5, a shared expert, a dense first
    # layer and a multi-token prediction module; the debug MoE's width, depth and active feed-forward (two routed
    # experts of 176 and one of 352).
    "deepseek_v3_debug": MoEArgs(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=8,
        head_dim=48,
        qk_norm=False,
        vocab_size=2048,
        norm_eps=1e-6,
        rope_theta=10000.0,
        max_seq_len=2048,
        q_lora_rank=96,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        dense_layers=1,
        dense_hidden_dim=704,
        n_experts=8,
        top_k=2,
        expert_hidden_dim=176,
        n_shared_experts=2,
        score_func="sigmoid",
        norm_topk=True,
        route_scale=2.5,
        n_group=4,
        topk_group=2,
        aux_loss_coef=0.0001,
        mtp_layers=1,
    ),
    # DeepSeek-V3 (671B, 37B active), its published config.json: 61 layers, the first 3 dense, 256 routed experts of
    # 2,048 (8 per token, within the best 4 of 8 groups) and one shared; latent attention of 128 heads; YaRN to 160k
    # positions from its pretraining's 4k; one multi-token prediction module (13.5B more with its own copies of the
    # embedding and head, as its files hold them: 684.5B).
    "deepseek_v3_671b": MoEArgs(
        dim=7168,
        n_layers=61,
        n_heads=128,
        n_kv_heads=128,
        head_dim=192,
        qk_norm=False,
        vocab_size=129280,
        norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling="yarn",
        rope_scaling_factor=40.0,
        rope_original_max_seq_len=4096,
        rope_attention_factor=1.0,
        rope_yarn_mscale_all_dim=1.0,
        max_seq_len=163840,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        dense_layers=3,
        dense_hidden_dim=18432,
        n_experts=256,
        top_k=8,
        expert_hidden_dim=2048,
        n_shared_experts=1,
        score_func="sigmoid",
        norm_topk=True,
        route_scale=2.5,
        n_group=8,
        topk_group=4,
        aux_loss_coef=0.0001,
        mtp_layers=1,
    ),
}
# Kimi K2 (1.03T, 32B active): DeepSeek-V3's architecture with 384 experts, no groups, half the heads, one dense layer
# and no multi-token prediction (its config.json of 0905, YaRN to 256k). For titan plan: it needs hundreds of GPUs.
FLAVORS["kimi_k2"] = dataclasses.replace(
    FLAVORS["deepseek_v3_671b"],
    n_heads=64,
    n_kv_heads=64,
    vocab_size=163840,
    rope_theta=50000.0,
    rope_scaling_factor=64.0,
    rope_yarn_beta_fast=1.0,
    rope_yarn_beta_slow=1.0,
    max_seq_len=262144,
    dense_layers=1,
    n_experts=384,
    route_scale=2.827,
    n_group=1,
    topk_group=1,
    aux_loss_coef=0.0,
    mtp_layers=0,
)
