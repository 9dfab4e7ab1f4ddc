"""The mixture-of-experts family against references computed another way: transformers' parameter count, a loop over
experts, routing and balancing by hand."""

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from titan import models
from titan.models.moe import FLAVORS, MoEArgs, MoETransformer, active_params
from titan.models.moe.experts import GroupedExperts, grouped_mm
from titan.models.moe.model import MoE
from titan.models.moe.routing import Router, Routing


def build(seed=0, **overrides) -> MoETransformer:
    args = models.model_args("moe", "debug", {"max_seq_len": 64, **overrides})
    with torch.device("meta"):
        model = MoETransformer(args)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model


def test_qwen3_30b_a3b_has_the_parameters_of_transformers_qwen3_moe():
    transformers = pytest.importorskip("transformers")
    args = FLAVORS["qwen3_30b_a3b"]
    config = transformers.Qwen3MoeConfig(
        hidden_size=args.dim, num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads, head_dim=args.head_dim, vocab_size=args.vocab_size,
        num_experts=args.n_experts, num_experts_per_tok=args.top_k, moe_intermediate_size=args.expert_hidden_dim,
        tie_word_embeddings=False,
    )  # fmt: skip
    with torch.device("meta"):
        theirs = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
        ours = sum(p.numel() for p in MoETransformer(args).parameters())
    assert ours == theirs
    # Qwen's published sizes: 30.5B, and 3.3B active (3.35B with the embedding, a lookup active_params leaves out).
    assert round(ours / 1e9, 1) == 30.5 and 3.3e9 <= active_params(args) + args.vocab_size * args.dim < 3.4e9


# DeepSeek-V3's config.json as DeepSeek publishes it (its fields titan reads), and Kimi K2's differences.
DEEPSEEK_V3_CONFIG = {
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc",
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "hidden_act": "silu",
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "num_nextn_predict_layers": 1,
}
KIMI_K2_CONFIG = {
    **DEEPSEEK_V3_CONFIG, "model_type": "kimi_k2", "vocab_size": 163840, "num_attention_heads": 64,
    "num_key_value_heads": 64, "n_routed_experts": 384, "routed_scaling_factor": 2.827, "n_group": 1, "topk_group": 1,
    "first_k_dense_replace": 1, "rope_theta": 50000.0, "max_position_embeddings": 262144, "num_nextn_predict_layers": 0,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
}  # fmt: skip


@pytest.mark.parametrize(
    "flavor, config, total, active, with_mtp",
    [("deepseek_v3_671b", DEEPSEEK_V3_CONFIG, 671.0, 37, 684.5), ("kimi_k2", KIMI_K2_CONFIG, 1026.4, 32, 1026.4)],
)
def test_deepseek_v3_and_kimi_k2_are_their_published_configs_and_sizes(flavor, config, total, active, with_mtp):
    """Each flavor is what titan reads from the published config.json (but the training choices), and has the
    parameters transformers builds from it, but for the multi-token prediction modules transformers leaves out; the
    published sizes: 671B with 37B active, and Kimi K2's 32B active (without the embedding, a lookup, as
    active_params counts); DeepSeek-V3's 684.5B with its MTP module and the module's own copies of the embedding and
    head, as its files hold them (DeepSeek says 685B)."""
    transformers = pytest.importorskip("transformers")
    from titan.models.moe.hf import TRAINING_CHOICES, args_from_hf_config

    args, read = FLAVORS[flavor], args_from_hf_config(config)
    assert args == dataclasses.replace(read, **{name: getattr(args, name) for name in TRAINING_CHOICES})
    hf_config = transformers.DeepseekV3Config(**{**config, "model_type": "deepseek_v3"})
    with torch.device("meta"):
        theirs = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(hf_config).parameters())
        params = dict(MoETransformer(args).named_parameters())
    ours = sum(p.numel() for name, p in params.items() if not name.startswith("mtp."))
    assert ours == theirs and round(ours / 1e9, 1) == total
    assert round(active_params(dataclasses.replace(args, mtp_layers=0)) / 1e9) == active
    copies = 2 * args.vocab_size * args.dim * args.mtp_layers
    assert round((sum(p.numel() for p in params.values()) + copies) / 1e9, 1) == with_mtp


def test_debug_flavor_has_the_dense_debug_models_active_feed_forward():
    """The comparison in docs/moe.md: the same attention and active SwiGLU width per token as the dense debug Llama."""
    moe, dense = FLAVORS["debug"], models.get_model_spec("llama3").flavors["debug"]
    assert (moe.top_k + moe.n_shared_experts) * moe.expert_hidden_dim == dense.ffn_hidden_dim == moe.dense_hidden_dim
    assert moe.n_heads * moe.head_dim == dense.dim and moe.n_kv_heads == dense.n_kv_heads


@pytest.mark.parametrize(
    "dim,hidden,dtype",
    [(8, 12, torch.float32), (6, 10, torch.float32), (8, 12, torch.float64)],
    ids=["grouped", "loop: rows of 24 bytes", "loop: float64"],  # what torch's grouped matmul does not take
)
def test_grouped_experts_equal_a_loop_over_experts(dim, hidden, dtype):
    torch.manual_seed(0)
    experts = GroupedExperts(dim, hidden, 4).to(dtype)
    for w in experts.parameters():
        torch.nn.init.normal_(w, std=0.3)
    counts = torch.tensor([3, 0, 5, 2])  # an expert without tokens
    x = torch.randn(int(counts.sum()), dim, dtype=dtype, requires_grad=True)
    out = experts(x, counts)
    grad = torch.randn_like(out)
    out.backward(grad)
    reference, start = [], 0
    params = [w.detach().clone().requires_grad_() for w in (experts.w1, experts.w2, experts.w3)]
    x_ref = x.detach().clone().requires_grad_()
    for e, n in enumerate(counts.tolist()):
        piece = x_ref[start : start + n]
        reference.append((F.silu(piece @ params[0][e].T) * (piece @ params[2][e].T)) @ params[1][e].T)
        start += n
    torch.cat(reference).backward(grad)
    torch.testing.assert_close(out, torch.cat(reference), rtol=0, atol=1e-6)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=1e-6)
    for mine, theirs in zip((experts.w1, experts.w2, experts.w3), params):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=0, atol=1e-6)
    experts(x, counts).sum().backward()  # an expanded gradient, as a sum's backward gives, is taken too


def test_a_tokens_rows_do_not_depend_on_the_other_tokens_in_the_grouped_matmul():
    """What expert parallelism relies on: an expert's tokens give the same bits whatever other tokens share a call."""
    torch.manual_seed(0)
    x, w = torch.randn(10, 16), torch.randn(3, 8, 16)
    together = grouped_mm(x, w, torch.tensor([2, 5, 3]))
    alone = grouped_mm(x[2:7], w, torch.tensor([0, 5, 0]))
    assert torch.equal(together[2:7], alone)


def test_the_router_breaks_ties_by_expert_index_and_keeps_the_chosen_in_expert_order():
    router = Router(MoEArgs(dim=4, n_experts=6, top_k=3, score_func="softmax", norm_topk=True, route_scale=2.0))
    torch.nn.init.zeros_(router.gate.weight)  # every expert scores the same for every token
    router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.1, 0.0, 0.1]))  # 3 and 5 lead, then a tie of four
    scores, experts, weights = router(torch.randn(5, 4))
    assert experts.tolist() == [[0, 3, 5]] * 5  # the lowest index wins the tie; listed in expert order
    torch.testing.assert_close(scores, torch.full((5, 6), 1 / 6))  # the bias chooses, it does not weigh
    torch.testing.assert_close(weights, torch.full((5, 3), 2 / 3))  # normalised to 1, times route_scale 2


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_the_moe_layer_equals_its_definition_token_by_token(score_func):
    model = build(score_func=score_func, norm_topk=score_func == "sigmoid")
    moe: MoE = model.layers["1"].feed_forward
    moe.router.expert_bias.copy_(torch.linspace(-0.02, 0.03, 8))
    x = torch.randn(2, 5, 256)
    with torch.no_grad():
        out = moe(x)
    tokens = x.reshape(-1, 256)
    for t, token in enumerate(tokens):
        logits = moe.router.gate.weight @ token
        scores = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
        biased = (scores + moe.router.expert_bias).tolist()
        chosen = sorted(range(8), key=lambda e: (-biased[e], e))[:2]
        weights = scores[chosen] / (scores[chosen].sum() if score_func == "sigmoid" else 1)
        expected = moe.shared(token)
        for e, weight in zip(chosen, weights):
            w1, w2, w3 = moe.experts.w1[e], moe.experts.w2[e], moe.experts.w3[e]
            expected = expected + weight * (w2 @ (F.silu(w1 @ token) * (w3 @ token)))
        torch.testing.assert_close(out.reshape(-1, 256)[t], expected, rtol=1e-5, atol=1e-6)


def test_the_bias_moves_towards_the_mean_load_by_the_rate_unless_the_step_was_skipped():
    model = build(bias_update_rate=0.01)
    routers = model.routing.routers()
    loads = {"1": [5, 3, 4, 4, 4, 4, 4, 4], "2": [0, 0, 0, 0, 0, 0, 0, 32], "3": [4] * 8}
    for layer, load in loads.items():
        routers[layer].load.copy_(torch.tensor(load))
    metrics = model.routing.end_step((), torch.tensor(True))
    assert routers["1"].expert_bias.tolist() == pytest.approx([-0.01, 0.01, 0, 0, 0, 0, 0, 0])  # mean 4
    assert routers["2"].expert_bias.tolist() == pytest.approx([0.01] * 7 + [-0.01])
    assert routers["3"].expert_bias.tolist() == [0.0] * 8  # balanced: no move
    assert float(metrics["moe/load_max/2"]) == 8.0 and float(metrics["moe/load_min/2"]) == 0.0
    assert all(r.load.sum() == 0 for r in routers.values())  # counted afresh each step
    routers["1"].load.copy_(torch.tensor(loads["1"]))
    before = routers["1"].expert_bias.clone()
    model.routing.end_step((), torch.tensor(False))  # a skipped step leaves the state as it was
    assert torch.equal(routers["1"].expert_bias, before)


def test_the_balance_loss_and_its_gradient_equal_the_sequence_level_formula():
    """aux = coef * sum over rows of (row tokens x loss scale) * sum_i f_ri P_ri, by hand; its gradient reaches the
    router through the backward."""
    coef, scale, rows, seq = 0.1, 1 / 37, 2, 5
    model = build(aux_loss_coef=coef, bias_update_rate=0.0, resid_dropout=0.0)
    moe: MoE = model.layers["2"].feed_forward
    model.routing.set_loss_scale(scale)
    x = torch.randn(rows, seq, 256)
    moe(x).sum().backward()
    measured, gate_grad = moe.router.balance_loss.item(), moe.router.gate.weight.grad.clone()
    moe.router.gate.weight.grad = None
    with torch.no_grad():
        _, experts, _ = moe.router(x.reshape(-1, 256))
    scores = (x.reshape(-1, 256) @ moe.router.gate.weight.T).softmax(-1)  # with a gradient, by hand
    expected = 0.0
    for r in range(rows):
        chosen = experts[r * seq : (r + 1) * seq].flatten().tolist()
        f = torch.tensor([chosen.count(i) * 8 / (2 * seq) for i in range(8)])
        p = scores[r * seq : (r + 1) * seq].mean(0)
        expected = expected + coef * seq * scale * (f * p).sum()
    assert measured == pytest.approx(expected.item(), rel=1e-5)
    # The gate's gradient: the output's part (the same forward without the loss) plus the formula's.
    moe.aux_loss_coef = 0.0
    moe(x).sum().backward()
    expected.backward()
    torch.testing.assert_close(gate_grad, moe.router.gate.weight.grad, rtol=1e-5, atol=1e-8)


def test_loads_are_counted_once_per_training_forward_whatever_the_checkpointing():
    model = build()
    tokens = torch.randint(0, 2048, (2, 16))

    def loads():
        counted = torch.stack([r.load.clone() for r in model.routing.routers().values()])
        for r in model.routing.routers().values():
            r.load.zero_()
        return counted

    model(tokens).sum().backward()
    plain = loads()
    assert (plain.sum(1) == 2 * 16 * 2).all()  # every token, top_k times, in each MoE layer
    blocks = list(model.layers.values())
    forwards = [b.forward for b in blocks]
    for block, forward in zip(blocks, forwards):  # full activation checkpointing recomputes in the backward
        block.forward = lambda *a, f=forward, **k: checkpoint(f, *a, use_reentrant=False, **k)
    model(tokens).sum().backward()
    assert torch.equal(loads(), plain)
    with torch.no_grad():  # evaluation routes but does not count
        model(tokens)
    assert loads().sum() == 0


def test_checkpoints_hold_the_biases_and_loading_keeps_them():
    model = build()
    router = model.layers["3"].feed_forward.router
    router.expert_bias.fill_(0.25)
    state = model.state_dict()
    assert "layers.3.feed_forward.router.expert_bias" in state
    assert not any(name.endswith((".load", ".balance_loss")) for name in state)  # step counts are not state
    model.init_buffers()  # what a load does after the parameters and buffers are read
    assert (router.expert_bias == 0.25).all()


def test_routing_is_one_per_model_and_dense_models_have_none():
    assert models.get_model_spec("llama3").build.routing is None
    model = build()
    assert isinstance(model.routing, Routing)
    assert set(model.routing.routers()) == {"1", "2", "3"}  # the first layer is dense
    assert dataclasses.replace(FLAVORS["debug"], dense_layers=0).moe_layers == range(0, 4)


def test_compiled_experts_compute_what_eager_ones_do_in_fp32():
    """torch 2.13 traces its grouped matmul in bf16 only (its fake kernel refuses fp32, which the CPU runs): a
    compiled block runs the experts eagerly, with the same bits."""
    experts = GroupedExperts(dim=32, hidden=16, n_experts=4)
    for w in experts.parameters():
        torch.nn.init.normal_(w, generator=torch.Generator().manual_seed(0))
    x, counts = torch.randn(24, 32, generator=torch.Generator().manual_seed(1)), torch.tensor([5, 0, 12, 7])
    assert torch.equal(torch.compile(experts)(x, counts), experts(x, counts))


def test_the_router_and_the_experts_are_marked_for_the_profiler():
    """scripts/bench.py --compare moe sums the profiler's time under these marks (expert parallelism adds
    moe.dispatch and moe.combine around its all-to-alls)."""
    moe: MoE = build().layers["1"].feed_forward
    with torch.profiler.profile() as profile:
        moe(torch.randn(2, 5, 256)).sum().backward()
    marks = [e.key for e in profile.key_averages() if e.key.startswith("moe.")]
    assert sorted(marks) == ["moe.experts", "moe.router"]


@pytest.mark.parametrize("n_group, topk_group", [(1, 1), (4, 2), (8, 3)])
def test_group_limited_routing_chooses_and_weighs_as_transformers_deepseek_v3(n_group, topk_group):
    """DeepSeek-V3's router in transformers (sigmoid scores, the correction bias, experts chosen within the best
    groups, each scored by its two best; routed_scaling_factor 2.5) on 512 random tokens: the same experts for
    every token, weights within fp32 rounding."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = transformers.DeepseekV3Config(
        hidden_size=32, n_routed_experts=32, num_experts_per_tok=6, n_group=n_group, topk_group=topk_group,
        routed_scaling_factor=2.5, norm_topk_prob=True,
    )  # fmt: skip
    theirs = DeepseekV3TopkRouter(config)
    args = MoEArgs(dim=32, n_experts=32, top_k=6, score_func="sigmoid", norm_topk=True, route_scale=2.5,
                   n_group=n_group, topk_group=topk_group)  # fmt: skip
    ours = Router(args)
    torch.manual_seed(0)
    with torch.no_grad():
        theirs.weight.normal_(std=0.3)
        theirs.e_score_correction_bias.normal_(std=0.05)
        ours.gate.weight.copy_(theirs.weight)
        ours.expert_bias.copy_(theirs.e_score_correction_bias)
        x = torch.randn(512, 32)
        _, their_weights, their_experts = theirs(x)
        _, experts, weights = ours(x)
    order = their_experts.argsort(dim=-1)
    assert torch.equal(experts, their_experts.gather(1, order))
    torch.testing.assert_close(weights, their_weights.gather(1, order), rtol=1e-6, atol=0)
    if n_group > 1:  # the groups decide: some token's best experts overall lie outside its best groups
        overall = torch.sort(torch.sigmoid(x @ theirs.weight.T) + theirs.e_score_correction_bias, dim=-1,
                             descending=True, stable=True).indices[:, :6].sort(dim=-1).values  # fmt: skip
        assert not torch.equal(overall, experts)


@pytest.mark.parametrize(
    "overrides, words",
    [({"n_group": 3}, "n_group (3) must divide n_experts (8)"), ({"n_group": 4, "topk_group": 5}, "topk_group (5)"),
     ({"n_group": 4, "topk_group": 1, "top_k": 3}, "top_k (3) exceeds the 2 experts")],
)  # fmt: skip
def test_groups_that_cannot_route_are_refused_naming_the_field(overrides, words):
    args = dataclasses.replace(FLAVORS["debug"], **overrides)
    with pytest.raises(ValueError, match=re.escape(words)):
        args.validate()
