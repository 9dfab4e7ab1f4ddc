"""Conversion between Hugging Face `DeepseekV3ForCausalLM` checkpoints (DeepSeek-V3's and Kimi K2's config.json) and
titan's MoE family with latent attention (one of the moe family's two formats; titan/checkpoint/hf/ reads and
writes the files).

DeepSeek-V3 is titan's MoE with multi-head latent attention, sigmoid scores chosen within the best `topk_group` of
`n_group` groups with a per-expert correction bias, weights scaled by `routed_scaling_factor`, shared experts, and
its first `first_k_dense_replace` layers dense. The correction bias is the router's `expert_bias`, a buffer titan
moves while it trains, which the files hold as `mlp.gate.e_score_correction_bias`.

RoPE's rotated part of each head is stored in interleaved pairs, as titan computes it (transformers' default
`rope_interleave`), so no row moves. The experts are read and written as both formats do (experts.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from titan.models.decoder import hf as decoder
from titan.models.moe import hf_format_blockers
from titan.models.moe.args import LIMITS, MoEArgs
from titan.models.moe.hf.experts import check_experts, expert_names
from titan.schema import Flag, Integer, Number, Table, Text, optional

MODEL_TYPE = "deepseek_v3"  # config.json's; Kimi K2's names its own, for the same architecture
MODEL_TYPES = (MODEL_TYPE, "kimi_k2")
_LATENT = Integer(1, 2**14)  # a latent rank or a head part's width
# transformers' DeepseekV3Config defaults (DeepSeek-V3's own sizes) for the fields a config.json may leave out.
_HF_DEFAULTS = {
    "intermediate_size": 18432,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_group": 8,
    "topk_group": 4,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
}


def _size(arg: str) -> Integer:
    return decoder.hf_size(arg, LIMITS)


HF_CONFIG = Table(
    {
        **decoder.HF_CONFIG.fields,
        "intermediate_size": _size("dense_hidden_dim"),
        "moe_intermediate_size": _size("expert_hidden_dim"),
        "n_routed_experts": _size("n_experts"),
        "n_shared_experts": optional(Integer(0, LIMITS["n_experts"])),
        "num_experts_per_tok": _size("top_k"),
        "n_group": optional(_size("n_experts")),
        "topk_group": optional(_size("n_experts")),
        "routed_scaling_factor": Number(0, above=True),
        "norm_topk_prob": Flag(),
        "first_k_dense_replace": optional(Integer(0, LIMITS["n_layers"])),
        "moe_layer_freq": Integer(1, LIMITS["n_layers"]),
        "scoring_func": Text(),
        "topk_method": Text(),
        "q_lora_rank": optional(_LATENT),
        "kv_lora_rank": _LATENT,
        "qk_nope_head_dim": _LATENT,
        "qk_rope_head_dim": _LATENT,
        "v_head_dim": _LATENT,
        "rope_interleave": Flag(),
        "num_nextn_predict_layers": Integer(0, LIMITS["n_layers"]),  # DeepSeek's name
        "num_mtp_layers": Integer(0, LIMITS["n_layers"]),  # transformers 5's
        "tie_word_embeddings": Flag(),
        "attention_bias": Flag(),
    },
    required=frozenset(
        {"hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "moe_intermediate_size"}
        | {"n_routed_experts", "num_experts_per_tok"}
    ),
)
# Values of DeepSeek's own fields other than V3's, which titan does not build: DeepSeek-V2's routing and a MoE
# layer every k layers.
_ONLY = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1, "rope_interleave": True}


# --------------------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------------------


def args_from_hf_config(hf: dict[str, Any]) -> MoEArgs:
    """`MoEArgs` for an HF DeepSeek-V3 (or Kimi K2) `config.json` dict; unsupported features and values of the
    wrong type or out of bounds raise ValueError naming the field."""
    model_type = hf.get("model_type", MODEL_TYPE)
    decoder.check_config(hf, HF_CONFIG, model_type if model_type in MODEL_TYPES else MODEL_TYPE, ("attention_bias",))
    for field, value in _ONLY.items():
        if hf.get(field, value) != value:
            raise ValueError(f"{field}: titan reads DeepSeek-V3's {value!r} only, got {hf[field]!r}")
    h = {**_HF_DEFAULTS, **{key: value for key, value in hf.items() if value is not None}}
    if not h["n_shared_experts"]:
        raise ValueError("n_shared_experts: 0 is not read; titan builds DeepSeek-V3 with its shared experts")
    n_layers, n_heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    mtp = {hf[key] for key in ("num_nextn_predict_layers", "num_mtp_layers") if key in hf}
    if len(mtp) > 1:
        raise ValueError(f"num_nextn_predict_layers ({hf['num_nextn_predict_layers']}) and num_mtp_layers differ")
    rope = decoder.rope_settings(hf)
    if rope.get("rope_scaling") == "yarn":
        params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope["rope_yarn_mscale_all_dim"] = float(params.get("mscale_all_dim") or 0.0)
    args = MoEArgs(
        dim=hf["hidden_size"],
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_heads,  # unused by latent attention
        head_dim=h["qk_nope_head_dim"] + h["qk_rope_head_dim"],
        qk_norm=False,
        vocab_size=hf["vocab_size"],
        norm_eps=float(h["rms_norm_eps"]),
        max_seq_len=h["max_position_embeddings"],
        tie_embeddings=hf.get("tie_word_embeddings", False),
        attn_dropout=float(hf.get("attention_dropout") or 0.0),
        q_lora_rank=hf.get("q_lora_rank", _HF_DEFAULTS["q_lora_rank"]) or 0,  # null: no query latent
        kv_lora_rank=h["kv_lora_rank"],
        qk_nope_head_dim=h["qk_nope_head_dim"],
        qk_rope_head_dim=h["qk_rope_head_dim"],
        v_head_dim=h["v_head_dim"],
        dense_layers=min(h["first_k_dense_replace"], n_layers),
        dense_hidden_dim=h["intermediate_size"],
        n_experts=hf["n_routed_experts"],
        top_k=hf["num_experts_per_tok"],
        expert_hidden_dim=hf["moe_intermediate_size"],
        n_shared_experts=h["n_shared_experts"],
        score_func="sigmoid",
        norm_topk=h["norm_topk_prob"],
        route_scale=float(h["routed_scaling_factor"]),
        n_group=h["n_group"],
        topk_group=h["topk_group"],
        mtp_layers=mtp.pop() if mtp else 0,
        **rope,
    )
    args.validate()
    return args


def hf_config_from_args(args: MoEArgs, dtype: torch.dtype | str = "float32") -> dict[str, Any]:
    """A `config.json` dict for `args` that `transformers.DeepseekV3Config(**d)` accepts; ValueError for args
    DeepSeek-V3 cannot express."""
    args.validate()
    if blockers := hf_format_blockers(args):
        raise ValueError("; ".join(blockers))
    dtype = str(dtype).removeprefix("torch.")
    rope = decoder.rope_config(args)
    if args.rope_yarn_mscale_all_dim and rope["rope_scaling"]:
        for params in (rope["rope_parameters"], rope["rope_scaling"]):
            params["mscale_all_dim"] = float(args.rope_yarn_mscale_all_dim)
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": MODEL_TYPE,
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_heads,
        "vocab_size": args.vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        **rope,
        "rope_interleave": True,
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": args.attn_dropout,
        "q_lora_rank": args.q_lora_rank or None,
        "kv_lora_rank": args.kv_lora_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim,
        "first_k_dense_replace": args.dense_layers,
        "intermediate_size": args.dense_hidden_dim,
        "n_routed_experts": args.n_experts,
        "num_experts_per_tok": args.top_k,
        "moe_intermediate_size": args.expert_hidden_dim,
        "n_shared_experts": args.n_shared_experts,
        "norm_topk_prob": args.norm_topk,
        "routed_scaling_factor": args.route_scale,
        "n_group": args.n_group,
        "topk_group": args.topk_group,
        "num_nextn_predict_layers": args.mtp_layers,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": dtype,
        "torch_dtype": dtype,
    }


# --------------------------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------------------------

# titan name -> HF name of each layer's tensors (prefixed with `layers.{i}.` and `model.layers.{i}.`).
_NORMS = {"attention_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight"}
_LATENT_ATTENTION = {
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
}
_QUERY = {"attention.wq.weight": "self_attn.q_proj.weight"}
_QUERY_LATENT = {
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
}
_SHARED = {f"feed_forward.shared.{titan}.weight": f"mlp.shared_experts.{hf}" for titan, hf in
           (("w1", "gate_proj.weight"), ("w2", "down_proj.weight"), ("w3", "up_proj.weight"))}  # fmt: skip
_ROUTER = {
    "feed_forward.router.gate.weight": "mlp.gate.weight",
    "feed_forward.router.expert_bias": "mlp.gate.e_score_correction_bias",  # a buffer: the router's state
}


# Each multi-token prediction layer's own tensors (titan: mtp.{L}.*, HF: model.layers.{L}.*, L counting on from the
# layers), besides its block's; and its copies of the embedding and the head, which it shares in titan.
_MTP = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
        "norm.weight": "shared_head.norm.weight"}  # fmt: skip
_MTP_COPIES = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}


def _mtp_layers(args: MoEArgs) -> range:
    return range(args.n_layers, args.n_layers + args.mtp_layers)


def hf_sources(args: MoEArgs) -> dict[str, decoder.Source]:
    """Where each titan parameter, and the routers' biases, come from: name -> (HF tensor name, or the names of the
    experts' tensors it stacks; rows, always None: no row moves). A multi-token prediction layer's block is named
    as a MoE layer's, under its own layer number."""
    attention = {**_NORMS, **_LATENT_ATTENTION, **(_QUERY_LATENT if args.q_lora_rank else _QUERY)}
    dense = {**attention, **decoder.DENSE_NAMES}
    moe = {**attention, **_ROUTER, **expert_names(args.n_experts), **_SHARED}
    sources = decoder.decoder_sources(args, lambda i: dense if i < args.dense_layers else moe, {})
    for layer in _mtp_layers(args):
        at = f"model.layers.{layer}."
        for titan, hf in moe.items():
            hf_name = at + hf if isinstance(hf, str) else tuple(at + name for name in hf)
            sources[f"mtp.{layer}.block.{titan}"] = (hf_name, None)
        sources |= {f"mtp.{layer}.{titan}": (at + hf, None) for titan, hf in _MTP.items()}
    return sources


def export_copies(args: MoEArgs) -> dict[str, str]:
    """{HF tensor: the HF tensor it copies}: each multi-token prediction layer's embedding and head, as DeepSeek's
    files hold them."""
    if args.tie_embeddings:  # the head is the embedding
        return {f"model.layers.{layer}.{name}": "model.embed_tokens.weight" for layer in _mtp_layers(args)
                for name in _MTP_COPIES}  # fmt: skip
    return {f"model.layers.{layer}.{name}": hf for layer in _mtp_layers(args) for name, hf in _MTP_COPIES.items()}


def held_args(args: MoEArgs, names) -> tuple[MoEArgs, str | None]:
    """The args of the model the files hold, and a note where they differ from config.json's: transformers' own
    save_pretrained writes DeepSeek-V3 without its multi-token prediction layers (though its config names them),
    which then are not read. Files with some of a layer's tensors are left to check_hf_names to list what lacks."""
    held = [layer for layer in _mtp_layers(args) if any(name.startswith(f"model.layers.{layer}.") for name in names)]
    if held or not args.mtp_layers:
        return args, None
    note = (f"config.json names {args.mtp_layers} multi-token prediction layer(s) (num_nextn_predict_layers) that "
            "its files do not hold, as transformers' save_pretrained writes them: read without them")  # fmt: skip
    return dataclasses.replace(args, mtp_layers=0), note


def check_hf_names(names, args: MoEArgs) -> dict[str, str]:
    """ValueError naming experts of another number or form, or listing the missing and unexpected tensors; returns
    the copies the files hold, each of which must equal its original: a tied head, and each multi-token prediction
    layer's embedding and head."""
    names = {name for name in names if not decoder.IGNORED_HF.search(name)}
    check_experts(names, args.n_experts, "n_routed_experts")
    mtp_copies = {copy: original for copy, original in export_copies(args).items() if copy in names}
    return {**decoder.check_names(names - set(mtp_copies), args, hf_sources(args)), **mtp_copies}
