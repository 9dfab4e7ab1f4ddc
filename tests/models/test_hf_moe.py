"""HF Qwen3-MoE <-> titan's moe: a tiny random `Qwen3MoeForCausalLM` and titan's MoETransformer on the weights read
from its files give the same logits, which checks titan's routing (softmax scores, top-k, norm_topk_prob) against
transformers'; and the config mapping, both ways, with what it refuses.

The model (helpers.tiny_qwen3_moe) has a dense first layer and MoE layers of 8 experts, 2 per token, with and
without norm_topk_prob, tied and untied; grouped-query attention with heads wider than hidden_size / heads and
q/k norms; random norm weights.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import TOL, max_diff, tiny_qwen3_moe  # noqa: E402
from titan import models  # noqa: E402
from titan.checkpoint.hf import open_hf, read_into, read_part  # noqa: E402
from titan.checkpoint.hf.files import stacked  # noqa: E402
from titan.models.moe import FLAVORS, MoETransformer  # noqa: E402
from titan.models.moe.hf import (  # noqa: E402
    args_from_hf_config,
    check_hf_buffers,
    check_hf_names,
    hf_config_from_args,
    hf_sources,
)

BATCH, SEQ = 2, 24
SPEC = models.get_model_spec("moe")


@pytest.fixture(scope="module", params=[(True, False), (False, False), (True, True)],
                ids=["norm_topk", "no_norm_topk", "tied"])  # fmt: skip
def hf_model(request, tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    norm_topk, tied = request.param
    path = tmp_path_factory.mktemp("qwen3_moe")
    return path, tiny_qwen3_moe(path, norm_topk=norm_topk, tied=tied)


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, 320, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))


def titan_logits(path: Path, tokens: torch.Tensor, **change) -> torch.Tensor:
    """titan's moe, with the args of the HF folder at `path` (changed by `change`), on its weights as titan's HF
    reader fills them; the routing biases at zero, as init_weights leaves them."""
    hf = open_hf(path, SPEC)
    with torch.device("meta"):
        model = MoETransformer(dataclasses.replace(hf.args, **change))
    model.to_empty(device="cpu")
    model.init_weights(0)
    read_into(hf, model.named_parameters(), "reading")
    with torch.no_grad():
        return model.eval()(tokens)


def test_titan_moe_on_the_imported_weights_gives_transformers_logits(hf_model, tokens):
    path, model = hf_model
    with torch.no_grad():
        theirs = model(tokens).logits
    assert theirs.abs().max() > 1  # not a comparison of near-zero numbers
    assert max_diff(titan_logits(path, tokens), theirs) < TOL  # measured 1.2e-6 (see helpers.tiny_qwen3_moe)


@pytest.mark.parametrize("wrong", ["norm_topk", "top_k"])
def test_the_comparison_sees_the_routing(hf_model, tokens, wrong):
    """The same weights routed otherwise are far from transformers' logits: the test above checks the routing."""
    path, model = hf_model
    change = {"norm_topk": not model.config.norm_topk_prob} if wrong == "norm_topk" else {"top_k": 3}
    with torch.no_grad():
        theirs = model(tokens).logits
    assert max_diff(titan_logits(path, tokens, **change), theirs) > 0.1


def test_the_config_maps_to_args_and_back_to_what_transformers_builds(hf_model):
    path, model = hf_model
    args = args_from_hf_config(model.config.to_dict())
    assert (args.dense_layers, args.n_experts, args.top_k, args.expert_hidden_dim) == (1, 8, 2, 32)
    assert (args.head_dim, args.dense_hidden_dim, args.qk_norm, args.score_func) == (24, 96, True, "softmax")
    assert (args.norm_topk, args.tie_embeddings) == (model.config.norm_topk_prob, model.config.tie_word_embeddings)
    config = hf_config_from_args(args)
    assert args_from_hf_config(config) == args
    rebuilt = transformers.Qwen3MoeConfig(**config)
    with torch.device("meta"):
        theirs = transformers.Qwen3MoeForCausalLM(rebuilt)
    shapes = {name: list(p.shape) for name, p in model.state_dict().items()}
    assert {name: list(p.shape) for name, p in theirs.state_dict().items()} == shapes


def test_the_sources_name_every_tensor_of_the_files_once(hf_model):
    path, model = hf_model
    args = args_from_hf_config(model.config.to_dict())
    hf = open_hf(path, SPEC)  # the files' names and shapes, checked against the config
    named = [name for hf_name, _ in hf_sources(args).values() for name in stacked(hf_name)]
    assert len(named) == len(set(named)) and set(named) | set(hf.copies) == set(hf.files)
    experts, rows = hf_sources(args)["layers.1.feed_forward.experts.w2"]
    assert experts == tuple(f"model.layers.1.mlp.experts.{e}.down_proj.weight" for e in range(8)) and rows is None


def hf_config(**change) -> dict:
    """The tiny model's config.json, changed."""
    config = hf_config_from_args(
        dataclasses.replace(FLAVORS["qwen3_30b_a3b"], dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=24,
                            vocab_size=320, n_experts=8, top_k=2, expert_hidden_dim=32, dense_hidden_dim=96)
    )  # fmt: skip
    return {key: value for key, value in {**config, **change}.items() if value is not None}


@pytest.mark.parametrize(
    "change, dense",
    [({"mlp_only_layers": [0, 1]}, 2), ({"mlp_only_layers": []}, 0), ({"mlp_only_layers": [1, 0, 7]}, 2),
     ({"decoder_sparse_step": 4, "mlp_only_layers": [0, 1, 2]}, 3), ({"decoder_sparse_step": 5}, 4)],
)  # fmt: skip
def test_the_first_layers_dense_convert_as_transformers_places_its_experts(change, dense):
    config = hf_config(**change)
    assert args_from_hf_config(config).dense_layers == dense
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**config))
    moe = [hasattr(layer.mlp, "experts") for layer in model.model.layers]
    assert moe == [i >= dense for i in range(4)]


@pytest.mark.parametrize(
    "change, words",
    [({"mlp_only_layers": [1]}, "mlp_only_layers = [1] makes layers [1] dense"),
     ({"mlp_only_layers": [0, 2]}, "mlp_only_layers = [0, 2] makes layers [0, 2] dense"),
     ({"decoder_sparse_step": 2}, "decoder_sparse_step = 2 makes layers [0, 2] dense"),
     ({"num_local_experts": 16}, "num_experts (8) and num_local_experts (16) differ"),
     ({"num_experts": None}, "has no 'num_experts'"),
     ({"num_experts_per_tok": 9}, "num_experts_per_tok (9) cannot exceed num_experts (8)"),
     ({"num_experts": 0}, "num_experts must be an integer in [1, 4096], got 0"),
     ({"norm_topk_prob": "yes"}, "norm_topk_prob must be true or false, got 'yes'"),
     ({"moe_intermediate_size": 1.5}, "moe_intermediate_size must be an integer"),
     ({"use_sliding_window": True}, "use_sliding_window: not supported"),
     ({"model_type": "qwen3"}, "model_type: expected 'qwen3_moe', got 'qwen3'"),
     ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e6, "factor": 4.0}},
      "rope_type: 'longrope' is not supported")],
)  # fmt: skip
def test_configs_titan_cannot_build_are_refused_naming_the_field(change, words):
    with pytest.raises(ValueError) as error:
        args_from_hf_config(hf_config(**change))
    assert words in str(error.value)


@pytest.mark.parametrize(
    "change, words",
    [({"qk_norm": False}, "qk_norm = false: Qwen3-MoE normalises every head's queries and keys"),
     ({"n_shared_experts": 2}, "n_shared_experts = 2: Qwen3-MoE has no shared experts"),
     ({"score_func": "sigmoid"}, "score_func = 'sigmoid': Qwen3-MoE scores experts by softmax"),
     ({"route_scale": 2.5}, "route_scale = 2.5: Qwen3-MoE does not scale the routing weights"),
     ({"n_group": 8, "topk_group": 4}, "n_group = 8: Qwen3-MoE chooses among all its experts")],
)  # fmt: skip
def test_flavors_qwen3_moe_cannot_express_are_refused(change, words):
    args = dataclasses.replace(FLAVORS["qwen3_30b_a3b"], **change)
    with pytest.raises(ValueError, match=words):
        hf_config_from_args(args)
    hf_config_from_args(FLAVORS["qwen3_30b_a3b"])  # which it can


def test_an_export_refusal_names_every_blocker_at_once():
    """DeepSeek-V3-style routing has five things Qwen3-MoE has no place for: one refusal lists them all, rather
    than one per attempt."""
    args = dataclasses.replace(FLAVORS["qwen3_30b_a3b"], qk_norm=False, n_shared_experts=1, score_func="sigmoid",
                               route_scale=2.5, n_group=8, topk_group=4)  # fmt: skip
    with pytest.raises(ValueError) as error:
        hf_config_from_args(args)
    named = [part.split(" = ")[0] for part in str(error.value).split("; ")]
    assert named == ["qk_norm", "n_shared_experts", "score_func", "route_scale", "n_group"]


def test_the_files_must_hold_the_experts_the_config_says_one_tensor_each(hf_model):
    path, model = hf_model
    args = args_from_hf_config(model.config.to_dict())
    names = set(open_hf(path, SPEC).files)
    extra = {name.replace(".experts.7.", ".experts.8.") for name in names if ".experts.7." in name}
    with pytest.raises(ValueError, match=r"model.layers.1.mlp holds 9 experts, but num_experts in config.json is 8"):
        check_hf_names(names | extra, args)
    fused = {n for n in names if ".experts." not in n} | {"model.layers.1.mlp.experts.gate_up_proj"}
    with pytest.raises(ValueError, match="model.layers.1.mlp.experts.gate_up_proj: experts fused into one tensor"):
        check_hf_names(fused, args)


def test_only_routing_biases_at_zero_export():
    args = FLAVORS["qwen3_30b_a3b"]
    check_hf_buffers(args, {"layers.0.feed_forward.router.expert_bias": torch.zeros(128)})
    moved = {"layers.0.feed_forward.router.expert_bias": torch.zeros(128), "layers.1.feed_forward.router.expert_bias":
             torch.full((128,), -0.002)}  # fmt: skip
    with pytest.raises(ValueError, match=r"layers.1.feed_forward.router.expert_bias is not zero \(up to 0.002\).*"
                                         "model.overrides.bias_update_rate = 0"):  # fmt: skip
        check_hf_buffers(args, moved)


def test_a_shard_of_experts_reads_only_their_tensors(hf_model):
    """What an expert-parallel rank holding experts 2 and 5 of a layer reads: their tensors, stacked, and no other."""
    path, model = hf_model
    hf = open_hf(path, SPEC)
    values, read = read_part(hf, "layers.1.feed_forward.experts.w3", [torch.tensor([2, 5]), torch.arange(32),
                                                                       torch.arange(64)])  # fmt: skip
    up = model.model.layers[1].mlp.experts.gate_up_proj[:, 32:]  # transformers fuses gate and up in memory
    assert torch.equal(values, up[[2, 5]]) and read == 2 * 32 * 64 * 4


def test_a_run_that_cannot_export_is_told_at_start_up_and_the_qwen3_recipe_exports(caplog):
    """The debug MoE (shared experts, no q/k norms, moving biases) is told at start-up, every blocker at once, that
    its model will not export; recipes/qwen3_30b_a3b.toml balances without routing biases, so its model does."""
    from conftest import ROOT
    from titan.config import load_config
    from titan.train.model import resolve_args, warn_of_an_impossible_export

    told = {}
    for recipe in ("debug_moe", "qwen3_30b_a3b"):
        config = load_config(ROOT / "recipes" / f"{recipe}.toml", [], 16)
        caplog.clear()
        with caplog.at_level("WARNING", logger="titan"):
            warn_of_an_impossible_export(config, resolve_args(config))
        told[recipe] = caplog.text
    assert "will not export to Hugging Face" in told["debug_moe"]
    assert all(field in told["debug_moe"] for field in ("qk_norm", "n_shared_experts", "bias_update_rate"))
    assert told["qwen3_30b_a3b"] == ""
    config = load_config(ROOT / "recipes" / "qwen3_30b_a3b.toml", [], 16)
    assert transformers.Qwen3MoeConfig(**hf_config_from_args(resolve_args(config))).num_experts == 128
