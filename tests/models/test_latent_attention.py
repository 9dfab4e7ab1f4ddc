"""DeepSeek's multi-head latent attention against transformers' own (`DeepseekV3Attention`, fp32): the same output
for the same weights, with the query's latent and without, and a debug MoE built on it that trains and decodes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import max_diff  # noqa: E402
from titan.models.decoder.latent_attention import LatentAttention  # noqa: E402
from titan.models.decoder.rope import rope_table  # noqa: E402
from titan.models.moe import FLAVORS, MoETransformer  # noqa: E402
from titan.tools.generate import generate  # noqa: E402

MLA = {"kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12}


@pytest.mark.parametrize("q_lora_rank", [0, 24], ids=["plain_query", "query_latent"])
def test_latent_attention_gives_transformers_deepseek_v3_output(q_lora_rank):
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    config = transformers.DeepseekV3Config(
        hidden_size=64, num_attention_heads=4, q_lora_rank=q_lora_rank or None, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, rope_theta=10000.0, rms_norm_eps=1e-6,
        attn_implementation="sdpa", max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    theirs = hf.DeepseekV3Attention(config, layer_idx=0).float().eval()
    for p in theirs.parameters():
        torch.nn.init.normal_(p, std=0.2) if p.ndim > 1 else torch.nn.init.uniform_(p, 0.5, 1.5)
    args = dataclasses.replace(FLAVORS["debug"], dim=64, n_heads=4, q_lora_rank=q_lora_rank, norm_eps=1e-6,
                               rope_theta=10000.0, max_seq_len=64, **MLA)  # fmt: skip
    ours = LatentAttention(args).eval()
    names = {"wkv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj"}
    names |= {"wq_a": "q_a_proj", "q_a_norm": "q_a_layernorm", "wq_b": "q_b_proj"} if q_lora_rank else {"wq": "q_proj"}
    with torch.no_grad():
        for mine, hf_name in names.items():
            getattr(ours, mine).weight.copy_(getattr(theirs, hf_name).weight)
        x = torch.randn(2, 20, 64)
        positions = torch.arange(20)[None].expand(2, -1)
        cos_sin = hf.DeepseekV3RotaryEmbedding(config)(x, positions)
        expected = theirs(x, position_embeddings=cos_sin, attention_mask=None)[0]
        got = ours(x, rope_table(args)[None], torch.arange(2), None)
    assert expected.abs().max() > 0.1
    assert max_diff(got, expected) < 1e-5


def test_a_debug_moe_on_latent_attention_trains_and_decodes_as_it_computes():
    """The debug MoE with latent attention: a training step lowers nothing to NaN and moves every parameter, and
    greedy decoding with the cache gives the tokens full forwards give."""
    args = dataclasses.replace(FLAVORS["debug"], q_lora_rank=24, **MLA)
    with torch.device("meta"):
        model = MoETransformer(args)
    model.to_empty(device="cpu")
    model.init_weights(0)
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "gate" not in n)
    model.eval()
    prompt = tokens[0, :6].tolist()
    cached = generate(model, [prompt], 8).tokens[0]
    with torch.no_grad():
        sequence = list(prompt)
        for _ in range(8):
            sequence.append(int(model(torch.tensor([sequence]))[0, -1].argmax()))
    assert cached == sequence[len(prompt) :]
    cache = model.kv_cache(1, 16)
    with torch.no_grad():
        model(torch.tensor([prompt]), cache=cache)
    # The cache holds each token's latent and rotated key, one for all heads, not their keys and values.
    assert cache[1].keys.shape == (1, 1, 16, args.kv_lora_rank + args.qk_rope_head_dim) and cache[1].values is None


@pytest.mark.parametrize(
    "overrides, degrees, words",
    [({}, {"tp": 3}, "parallel.tp = 3 must divide the model's n_heads (8): tensor parallelism splits latent attention"),
     ({"qk_rope_head_dim": 7}, {}, "qk_rope_head_dim (7) must be even for RoPE"),
     ({"q_lora_rank": -1}, {}, "q_lora_rank must be in [0, 16,384]")],
)  # fmt: skip
def test_latent_attention_that_cannot_run_is_refused_naming_the_field(overrides, degrees, words):
    args = dataclasses.replace(FLAVORS["debug"], **{**MLA, **overrides})
    with pytest.raises(ValueError) as error:
        args.validate()
        args.check_parallelism(degrees.get("tp", 1), 1, 1, degrees.get("cp", 1))
    assert words in str(error.value)


def test_latent_attention_splits_over_tp_by_its_heads_alone_and_over_cp():
    """Its latents stay whole on every tp rank, and n_kv_heads, which it does not use, need not divide by tp."""
    args = dataclasses.replace(FLAVORS["debug"], n_kv_heads=1, **MLA)
    args.validate()
    args.check_parallelism(2, 1, 1, 2)


def deepseek_v3_debug() -> MoETransformer:
    with torch.device("meta"):
        model = MoETransformer(dataclasses.replace(FLAVORS["deepseek_v3_debug"], max_seq_len=64))
    model.to_empty(device="cpu")
    model.init_weights(0)
    model.init_buffers()
    return model.eval()


PROMPTS = [[5, 17, 300, 41, 9], [7, 1000, 3]]


def tp_decode():
    """On each of 2 tensor-parallel ranks: the model's logits of a prompt, and greedy decoding of both prompts, each
    rank holding half the heads and decoding over their share of the absorbed latent."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from titan import models

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = deepseek_v3_debug()
    parallelize_module(model, mesh, models.get_model_spec("moe").tp_plan(model, False, False))
    with torch.no_grad():
        logits = model(torch.tensor([PROMPTS[0]]))[0]
    return logits, generate(model, PROMPTS, 12, group=mesh.get_group()).tokens


@pytest.mark.distributed
def test_latent_decoding_under_tensor_parallelism_is_one_process_s():
    from distributed import run_distributed

    model = deepseek_v3_debug()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPTS[0]]))[0]
    tokens = generate(model, PROMPTS, 12).tokens
    for rank_logits, rank_tokens in run_distributed(tp_decode, 2):
        assert max_diff(rank_logits, logits) < 1e-5 and rank_tokens == tokens
