"""The mixture-of-experts family's hyper-parameters (MoEArgs): Llama-style attention with Qwen3's per-head width
and q/k norms, and a feed-forward of routed experts (plus shared ones) in every layer after the first
`dense_layers`, checked once."""

from __future__ import annotations

import math
from dataclasses import dataclass

from titan.models.contract import PerRow
from titan.models.decoder.args import LIMITS as DECODER_LIMITS
from titan.models.decoder.args import DecoderArgs

# The decoder's bounds, and the heads' and experts'.
LIMITS = {
    **DECODER_LIMITS,
    "head_dim": 2**12,
    "n_experts": 2**12,
    "top_k": 2**12,
    "expert_hidden_dim": 2**17,
    "dense_hidden_dim": 2**19,
}
SCORE_FUNCTIONS = ("softmax", "sigmoid")


@dataclass
class MoEArgs(DecoderArgs):
    dim: int = 2048
    n_layers: int = 48
    n_heads: int = 32
    n_kv_heads: int = 4
    vocab_size: int = 151936
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    head_dim: int = 128  # each head's width: Qwen3's heads are wider than dim / n_heads
    qk_norm: bool = True  # RMSNorm of each head's queries and keys before RoPE (Qwen3)
    # DeepSeek's multi-head latent attention in place of grouped-query attention when kv_lora_rank > 0: keys and
    # values from a latent of kv_lora_rank per token, queries from one of q_lora_rank (0: from the hidden state);
    # each head's query and key a part without position and a rotated part (the key's one for all heads), values
    # v_head_dim wide. head_dim, n_kv_heads and qk_norm are then unused.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # YaRN's mscale_all_dim (DeepSeek's): with YaRN scaling, latent attention's scores are also multiplied by
    # (0.1 mscale_all_dim ln(factor) + 1)^2, on every dimension, not only the rotated ones (0: not).
    rope_yarn_mscale_all_dim: float = 0.0
    # The first `dense_layers` layers have a dense SwiGLU of dense_hidden_dim (DeepSeek-V3 keeps its first three).
    dense_layers: int = 0
    dense_hidden_dim: int = 6144
    # Each later layer: n_experts routed SwiGLU experts of expert_hidden_dim, top_k of them per token, plus
    # n_shared_experts that every token goes through (one SwiGLU of n_shared_experts x expert_hidden_dim).
    n_experts: int = 128
    top_k: int = 8
    expert_hidden_dim: int = 768
    n_shared_experts: int = 0
    score_func: str = "softmax"  # the router's scores: "softmax" over the experts, or each expert's "sigmoid"
    norm_topk: bool = True  # the chosen experts' weights divided by their sum
    route_scale: float = 1.0  # the chosen experts' weights multiplied by this (DeepSeek's routed_scaling_factor)
    # DeepSeek-V3's group-limited routing: the experts in n_group groups, a token's top_k chosen within its topk_group
    # best groups (each scored by its two best scores). 1 and 1: no groups.
    n_group: int = 1
    topk_group: int = 1
    # Load balancing, both over the step's global batch: DeepSeek-V3's per-expert bias added to the scores when
    # choosing experts (not when weighting them), moved by this much per step towards the mean load (0: off) ...
    bias_update_rate: float = 0.001
    # ... and the sequence-level auxiliary balance loss's coefficient (0: off).
    aux_loss_coef: float = 0.0
    # DeepSeek-V3's multi-token prediction: mtp_layers modules (its num_nextn_predict_layers) after the main stack,
    # module k predicting the token k + 1 after the next from module k - 1's hidden state and the embedding of the
    # token k ahead, each with a MoE block of its own; their mean loss, times mtp_loss_weight (V3's lambda for its
    # first 10T tokens, a training choice), is added to the objective. Generation predicts the next token alone.
    mtp_layers: int = 0
    mtp_loss_weight: float = 0.3

    @property
    def per_row(self) -> PerRow | None:
        if self.aux_loss_coef:
            why = "it weighs each row's tokens by that row's expert counts"
            return PerRow("the balance loss", why, "set aux_loss_coef to 0 (the bias balances alone)")
        return super().per_row

    @property
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim if self.kv_lora_rank else self.head_dim

    @property
    def softmax_scale(self) -> float:
        """Latent attention's scores' scale: 1/sqrt of a query's whole width, times YaRN's mscale squared."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        factor, mscale = self.rope_scaling_factor, self.rope_yarn_mscale_all_dim
        if self.rope_scaling == "yarn" and factor > 1 and mscale:
            scale *= (0.1 * mscale * math.log(factor) + 1) ** 2
        return scale

    @property
    def score_widths(self) -> tuple[int, int]:
        """A head's query (and key) width and its value's."""
        if self.kv_lora_rank:
            return self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim
        return self.head_dim, self.head_dim

    def attention_matmuls(self) -> int:
        """The attention's matmul weights: q, k, v and o, or latent attention's projections."""
        if not self.kv_lora_rank:
            return self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        (qk, v), heads, q_lora = self.score_widths, self.n_heads, self.q_lora_rank
        query = q_lora * (self.dim + heads * qk) if q_lora else self.dim * heads * qk
        latent = self.dim * (self.kv_lora_rank + self.qk_rope_head_dim)
        return query + latent + self.kv_lora_rank * heads * (self.qk_nope_head_dim + v) + heads * v * self.dim

    def attention_params(self, qk_norm: bool = False) -> int:
        if not self.kv_lora_rank:
            return super().attention_params(qk_norm)
        return self.attention_matmuls() + self.q_lora_rank + self.kv_lora_rank + 2 * self.dim  # and the norms

    @property
    def stage_width(self) -> int:
        """Pipeline stages pass on, with the hidden states, the embeddings of the tokens each multi-token prediction
        depth looks ahead to: the first stage holds the embedding, the last the prediction modules."""
        return self.dim * (1 + self.mtp_layers)

    @property
    def moe_layers(self) -> range:
        """The layers with routed experts: those after the first dense_layers, and the multi-token prediction's
        blocks, layers n_layers to n_layers + mtp_layers - 1."""
        return range(self.dense_layers, self.n_layers + self.mtp_layers)

    def check_parallelism(self, tp: int, pp_stages: int, ep: int = 1, cp: int = 1) -> None:
        if self.n_experts % ep:
            raise ValueError(
                f"parallel.ep = {ep} must divide the model's n_experts ({self.n_experts}): each expert-parallel rank "
                "holds as many experts; use a divisor of n_experts"
            )
        if self.kv_lora_rank and self.n_heads % tp:
            raise ValueError(
                f"parallel.tp = {tp} must divide the model's n_heads ({self.n_heads}): tensor parallelism splits "
                "latent attention by heads, its latents (kv_lora_rank, q_lora_rank) whole on every rank; use a "
                "divisor of n_heads"
            )
        dense = ("dense_hidden_dim", self.dense_hidden_dim) if self.dense_layers else None
        self.check_layer_split(tp, pp_stages, dense, kv_heads=not self.kv_lora_rank)
        shared = self.n_shared_experts * self.expert_hidden_dim
        if shared % tp:
            raise ValueError(
                f"parallel.tp = {tp} must divide the model's shared experts' width ({self.n_shared_experts} x "
                f"{self.expert_hidden_dim}): tensor parallelism splits their hidden units as a dense feed-forward's; "
                f"use a parallel.tp that divides {shared}"
            )

    def block_params(self, layer: int) -> int:
        if layer < self.dense_layers:
            feed_forward = 3 * self.dim * self.dense_hidden_dim
        else:  # the router, the routed experts and the shared ones
            experts = self.n_experts + self.n_shared_experts
            feed_forward = self.dim * self.n_experts + 3 * self.dim * self.expert_hidden_dim * experts
        return self.attention_params(self.qk_norm) + feed_forward

    def _check_groups(self) -> None:
        if not 1 <= self.n_group <= self.n_experts or self.n_experts % self.n_group:
            raise ValueError(f"n_group ({self.n_group}) must divide n_experts ({self.n_experts})")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group ({self.topk_group}) must be in [1, n_group = {self.n_group}]")
        per_group = self.n_experts // self.n_group
        if self.n_group > 1 and per_group < 2:
            raise ValueError(
                f"n_group ({self.n_group}) leaves {per_group} expert per group; a group is scored by its two best"
            )
        if self.top_k > self.topk_group * per_group:
            raise ValueError(
                f"top_k ({self.top_k}) exceeds the {self.topk_group * per_group} experts of topk_group "
                f"({self.topk_group}) groups of {per_group}"
            )

    def validate(self) -> None:
        self.check_bounds(LIMITS, ("route_scale",))
        for name in ("bias_update_rate", "aux_loss_coef", "rope_yarn_mscale_all_dim"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0 (0: off), got {getattr(self, name)}")
        self.check_heads()
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k ({self.top_k}) cannot exceed n_experts ({self.n_experts}): a token picks top_k")
        self._check_groups()
        if self.kv_lora_rank:
            for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                if not 1 <= getattr(self, name) <= 2**14:
                    raise ValueError(f"{name} must be in [1, 16,384] for latent attention, got {getattr(self, name)}")
            if not 0 <= self.q_lora_rank <= 2**14:
                raise ValueError(f"q_lora_rank must be in [0, 16,384] (0: no query latent), got {self.q_lora_rank}")
            if self.qk_rope_head_dim % 2:
                raise ValueError(f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even for RoPE")
        if not 0 <= self.dense_layers <= self.n_layers:
            raise ValueError(f"dense_layers must be in [0, n_layers = {self.n_layers}], got {self.dense_layers}")
        if self.score_func not in SCORE_FUNCTIONS:
            raise ValueError(f"score_func must be one of {', '.join(SCORE_FUNCTIONS)}, got {self.score_func!r}")
        if self.n_shared_experts < 0:
            raise ValueError(f"n_shared_experts must be >= 0, got {self.n_shared_experts}")
        if not 0 <= self.mtp_layers <= LIMITS["n_layers"]:  # not n_layers: titan plan traces a few layers of a model
            raise ValueError(f"mtp_layers must be in [0, {LIMITS['n_layers']:,}] (0: none), got {self.mtp_layers}")
        if not 0 <= self.mtp_loss_weight < math.inf:
            raise ValueError(f"mtp_loss_weight must be a finite number >= 0, got {self.mtp_loss_weight}")
