"""HF DeepSeek-V3 <-> titan's moe with latent attention: a tiny random `DeepseekV3ForCausalLM` and titan's
MoETransformer on the weights (and routing biases) read from its files give the same logits, which checks latent
attention, the group-limited sigmoid routing with its correction bias and scale, the shared experts and the dense
first layer against transformers'; and the config mapping, both ways, with what it refuses.

The model is helpers.tiny_deepseek_v3: 3 layers, the first dense, 8 experts in 2 groups, 2 per token from the best
group, random routing biases; with the query's latent and without.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from helpers import TOL, max_diff, randomize_, tiny_deepseek_v3  # noqa: E402
from titan import models  # noqa: E402
from titan.checkpoint.hf import open_hf, read_into  # noqa: E402
from titan.checkpoint.hf.files import stacked  # noqa: E402
from titan.checkpoint.train_state import model_buffers  # noqa: E402
from titan.errors import ConfigError  # noqa: E402
from titan.models.moe import FLAVORS, MoETransformer  # noqa: E402
from titan.models.moe.hf import args_from_hf_config, hf_config_from_args, hf_sources  # noqa: E402

BATCH, SEQ = 2, 24
SPEC = models.get_model_spec("moe")


@pytest.fixture(scope="module", params=[24, None], ids=["query_latent", "plain_query"])
def hf_model(request, tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("deepseek_v3")
    return path, tiny_deepseek_v3(path, q_lora_rank=request.param)


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, 320, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))


def titan_model(path: Path, **change) -> MoETransformer:
    """titan's moe with the args of the HF folder at `path` (changed by `change`), its parameters and routing biases
    as titan's HF reader fills them."""
    hf = open_hf(path, SPEC)
    with torch.device("meta"):
        model = MoETransformer(dataclasses.replace(hf.args, **change))
    model.to_empty(device="cpu")
    model.init_weights(0)
    model.init_buffers()
    state = {**dict(model.named_parameters()), **model_buffers(model)}
    read_into(hf, [(name, t) for name, t in state.items() if name in hf.sources], "reading")
    return model.eval()


def test_titan_on_the_imported_weights_gives_transformers_logits(hf_model, tokens):
    path, model = hf_model
    with torch.no_grad():
        theirs, ours = model(tokens).logits, titan_model(path)(tokens)
    assert theirs.abs().max() > 1  # not a comparison of near-zero numbers
    assert max_diff(ours, theirs) < TOL


@pytest.mark.parametrize("wrong", ["routing_bias", "topk_group", "route_scale"])
def test_the_comparison_sees_the_routing(hf_model, tokens, wrong):
    """The same weights routed otherwise (biases at zero, both groups open, no scale) are far from transformers'
    logits: the test above checks each part of the routing."""
    path, model = hf_model
    change = {"topk_group": {"topk_group": 2}, "route_scale": {"route_scale": 1.0}}.get(wrong, {})
    ours = titan_model(path, **change)
    if wrong == "routing_bias":
        for bias in model_buffers(ours).values():
            bias.zero_()
    with torch.no_grad():
        assert max_diff(ours(tokens), model(tokens).logits) > 1e-2


def test_greedy_generation_continues_as_transformers_does(hf_model, tokens):
    from titan.tools.generate import generate

    path, model = hf_model
    prompt = tokens[:1, :6]
    theirs = model.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)[0, 6:]
    ours = generate(titan_model(path), [prompt[0].tolist()], 12).tokens[0]
    assert ours == theirs.tolist()


def test_the_config_maps_to_args_and_back_to_what_transformers_builds(hf_model):
    path, model = hf_model
    args = args_from_hf_config(model.config.to_dict())
    assert (args.kv_lora_rank, args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim) == (32, 16, 8, 12)
    assert (args.dense_layers, args.n_experts, args.top_k, args.n_shared_experts) == (1, 8, 2, 1)
    assert (args.score_func, args.route_scale, args.n_group, args.topk_group) == ("sigmoid", 2.5, 2, 1)
    assert args.q_lora_rank == (model.config.q_lora_rank or 0)
    config = hf_config_from_args(args)
    assert args_from_hf_config(config) == args
    with torch.device("meta"):
        theirs = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**config))
    shapes = {name: list(p.shape) for name, p in model.state_dict().items()}
    assert {name: list(p.shape) for name, p in theirs.state_dict().items()} == shapes


def test_the_sources_name_every_tensor_of_the_files_once(hf_model):
    path, model = hf_model
    hf = open_hf(path, SPEC)  # the files' names and shapes, checked against the config
    named = [name for hf_name, _ in hf_sources(hf.args).values() for name in stacked(hf_name)]
    assert len(named) == len(set(named)) and set(named) == set(hf.files)
    assert hf_sources(hf.args)["layers.2.feed_forward.router.expert_bias"] == (
        "model.layers.2.mlp.gate.e_score_correction_bias",
        None,
    )


def test_yarn_scales_latent_attention_scores_as_deepseek_does():
    """DeepSeek-V3's own rope_scaling (factor 40, mscale_all_dim 1): the scores' scale is 1/sqrt(192) times
    (0.1 ln 40 + 1)^2, as transformers' DeepseekV3Attention computes it, and the export writes it back."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    rope = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}  # fmt: skip
    config = {**hf_config_from_args(dataclasses.replace(FLAVORS["debug"], kv_lora_rank=32, score_func="sigmoid")),
              "rope_scaling": rope, "rope_parameters": None, "max_position_embeddings": 163840}  # fmt: skip
    args = args_from_hf_config(config)
    assert args.softmax_scale == pytest.approx(192**-0.5 * (0.1 * math.log(40) + 1) ** 2, rel=1e-12)
    assert (args.rope_scaling, args.rope_scaling_factor, args.rope_attention_factor) == ("yarn", 40, 1.0)
    theirs = hf.DeepseekV3Attention(transformers.DeepseekV3Config(**hf_config_from_args(args)), layer_idx=0)
    assert theirs.scaling == pytest.approx(args.softmax_scale, rel=1e-12)
    assert args_from_hf_config(hf_config_from_args(args)) == args


def hf_config(**change) -> dict:
    """The tiny model's config.json, changed."""
    args = dataclasses.replace(FLAVORS["debug"], kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16,
                               qk_rope_head_dim=8, v_head_dim=12, score_func="sigmoid", n_group=2)  # fmt: skip
    return {key: value for key, value in {**hf_config_from_args(args), **change}.items() if value is not None}


@pytest.mark.parametrize(
    "change, words",
    [({"topk_group": 3}, "topk_group (3) must be in [1, n_group = 2]"),
     ({"n_group": 3}, "n_group (3) must divide n_experts (8)"),
     ({"scoring_func": "softmax"}, "scoring_func: titan reads DeepSeek-V3's 'sigmoid' only, got 'softmax'"),
     ({"topk_method": "greedy"}, "topk_method: titan reads DeepSeek-V3's 'noaux_tc' only, got 'greedy'"),
     ({"moe_layer_freq": 2}, "moe_layer_freq: titan reads DeepSeek-V3's 1 only, got 2"),
     ({"rope_interleave": False}, "rope_interleave: titan reads DeepSeek-V3's True only, got False"),
     ({"n_shared_experts": 0}, "n_shared_experts: 0 is not read"),
     ({"kv_lora_rank": 0}, "kv_lora_rank must be an integer in [1, 16384], got 0"),
     ({"attention_bias": True}, "attention_bias: not supported"),
     ({"n_routed_experts": None}, "n_routed_experts"),
     ({"model_type": "deepseek_v2"}, "model_type: expected 'deepseek_v3', got 'deepseek_v2'")],
)  # fmt: skip
def test_configs_titan_cannot_build_are_refused_naming_the_field(change, words):
    with pytest.raises(ValueError) as error:
        from titan.models.moe.hf import deepseek_v3

        deepseek_v3.args_from_hf_config(hf_config(**change))
    assert words in str(error.value)


def test_a_kimi_k2_config_reads_as_deepseek_v3():
    assert args_from_hf_config(hf_config(model_type="kimi_k2")) == args_from_hf_config(hf_config())
    assert models.family_of_hf("kimi_k2") == models.family_of_hf("deepseek_v3") == "moe"


@pytest.mark.parametrize(
    "change, words",
    [({"score_func": "softmax"}, "score_func = 'softmax': DeepSeek-V3 scores experts by sigmoid"),
     ({"n_shared_experts": 0}, "n_shared_experts = 0: DeepSeek-V3 has shared experts in every MoE layer")],
)  # fmt: skip
def test_flavors_deepseek_v3_cannot_express_are_refused(change, words):
    args = dataclasses.replace(FLAVORS["debug"], kv_lora_rank=32, score_func="sigmoid")
    with pytest.raises(ValueError, match=words):
        hf_config_from_args(dataclasses.replace(args, **change))
    hf_config_from_args(args)  # which it can


# -- DeepSeek's FP8 block-quantized weights --------------------------------------------------------------------------

BLOCK = 16  # small blocks, so the tiny model's matrices have several, and shards start inside them


def fp8_copy(path: Path, out: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The folder at `path` as DeepSeek ships V3: every linear weight but the router's, the embedding and the head
    in float8 e4m3 with a float32 scale per BLOCK x BLOCK block (its largest magnitude over fp8's 448); returns
    {name: (the fp8 weight, its scales)}."""

    shutil.copytree(path, out)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [BLOCK, BLOCK]}
    (out / "config.json").write_text(json.dumps(config))
    tensors, quantized = load_file(out / "model.safetensors"), {}
    for name, w in list(tensors.items()):
        if w.ndim != 2 or any(part in name for part in ("embed_tokens", "lm_head", "mlp.gate.")):
            continue
        rows, cols = (-n % BLOCK for n in w.shape)  # wkv_a's 40 rows end in part of a block
        blocks = torch.nn.functional.pad(w, (0, cols, 0, rows)).unflatten(0, (-1, BLOCK)).unflatten(2, (-1, BLOCK))
        scale = blocks.abs().amax(dim=(1, 3)) / 448
        per_element = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[: w.shape[0], : w.shape[1]]
        tensors[name] = (w / per_element).to(torch.float8_e4m3fn)
        tensors[name + "_scale_inv"] = scale
        quantized[name] = (tensors[name], scale)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return quantized


@pytest.fixture(scope="module")
def fp8_model(hf_model, tmp_path_factory):
    path, model = hf_model
    out = tmp_path_factory.mktemp("fp8") / "hf"
    return out, fp8_copy(path, out), model


def block_by_block(w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The dequantized weight, one block at a time: the reference."""
    out = torch.empty(w8.shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK)
            out[rows, cols] = w8[rows, cols].float() * scale[i, j]
    return out


def test_fp8_weights_are_dequantized_by_their_blocks_scales_within_fp8_rounding(fp8_model):
    """Every quantized weight reads as its fp8 numbers times their blocks' scales, which is the original within
    e4m3's rounding (3 mantissa bits: 2^-4 of the value, or 2^-10 of the scale below fp8's smallest normal)."""
    folder, quantized, model = fp8_model
    hf = open_hf(folder, SPEC)
    assert hf.dtypes == "F32, F8_E4M3" and len(quantized) > 20
    original = model.state_dict()
    state = titan_model(folder).state_dict()
    for titan_name, (hf_name, _) in hf.sources.items():
        for e, name in enumerate(stacked(hf_name)):
            if name not in quantized:
                continue
            got = state[titan_name][e] if isinstance(hf_name, tuple) else state[titan_name]
            assert torch.equal(got, block_by_block(*quantized[name])), name
            scale = quantized[name][1].repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[: got.shape[0]]
            w = original[name] if name in original else None
            if w is not None:  # transformers fuses the experts in memory; their tensors are checked above
                assert ((got - w).abs() <= 2**-4 * w.abs() + 2**-10 * scale[:, : w.shape[1]]).all(), name


def test_a_shard_of_an_fp8_weight_reads_its_own_blocks_scales(fp8_model):
    """Rows 5 to 36 of wkv_b start and end inside blocks, and a rank's two experts are read alone: each reads as the
    same elements of the whole."""
    from titan.checkpoint.hf import read_part

    folder, quantized, _ = fp8_model
    hf = open_hf(folder, SPEC)
    whole, _ = read_part(hf, "layers.1.attention.wkv_b.weight", [torch.arange(112), torch.arange(32)])
    part, _ = read_part(hf, "layers.1.attention.wkv_b.weight", [torch.arange(5, 37), torch.arange(32)])
    assert torch.equal(part, whole[5:37])
    experts, _ = read_part(hf, "layers.2.feed_forward.experts.w2", [torch.tensor([3, 6]), torch.arange(64),
                                                                     torch.arange(7, 30)])  # fmt: skip
    down = [block_by_block(*quantized[f"model.layers.2.mlp.experts.{e}.down_proj.weight"]) for e in (3, 6)]
    assert torch.equal(experts, torch.stack(down)[:, :, 7:30])


@pytest.mark.parametrize("damage", ["no_scale", "wrong_scale", "inf_scale"])
def test_an_fp8_weight_without_its_scales_is_one_line(fp8_model, tmp_path, damage):

    folder, _, _ = fp8_model
    copy = tmp_path / "hf"

    shutil.copytree(folder, copy)
    tensors = load_file(copy / "model.safetensors")
    name = "model.layers.1.self_attn.kv_b_proj.weight_scale_inv"
    if damage == "no_scale":
        del tensors[name]
    elif damage == "wrong_scale":
        tensors[name] = tensors[name][:3]
    else:
        tensors[name][2, 1] = float("inf")
    save_file(tensors, copy / "model.safetensors")
    words = {"no_scale": "the files hold no model.layers.1.self_attn.kv_b_proj.weight_scale_inv",
             "wrong_scale": "weight_scale_inv is F32 [3, 2], but model.layers.1.self_attn.kv_b_proj.weight [112, 32] "
                            "in blocks of [16, 16] needs F32 [7, 2]",
             "inf_scale": "kv_b_proj.weight_scale_inv holds a scale that is not a finite number"}[damage]  # fmt: skip
    with pytest.raises(ConfigError, match=re.escape(words)):
        titan_model(copy)  # the shapes are checked on opening, the values as they are read


# -- multi-token prediction ------------------------------------------------------------------------------------------


def with_an_mtp_layer(path: Path, out: Path, model) -> torch.nn.Module:
    """The folder at `path` with a multi-token prediction layer as DeepSeek's files hold one (model.layers.3.*, the
    layer after the last: its norms, projection, block and head's norm, and its own copies of the embedding and the
    head), random; returns it as transformers' MtpLayer, which the reference runs."""

    from transformers.modeling_layers import MtpLayer
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    shutil.copytree(path, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    torch.manual_seed(3)
    layer = MtpLayer(model.config, hf.DeepseekV3DecoderLayer, hf.DeepseekV3RMSNorm, layer_idx=3).float().eval()
    randomize_(layer, seed=4)
    with torch.no_grad():
        layer.mtp_block.mlp.gate.e_score_correction_bias.copy_(0.1 * torch.randn(8))
    tensors = load_file(out / "model.safetensors")
    at, inner = "model.layers.3.", 32  # moe_intermediate_size
    for name, value in layer.state_dict().items():
        name = name.replace("mtp_block.", "").replace("post_norm.", "shared_head.norm.")
        if name == "mlp.experts.gate_up_proj":
            for e, fused in enumerate(value):
                tensors[f"{at}mlp.experts.{e}.gate_proj.weight"] = fused[:inner].clone()
                tensors[f"{at}mlp.experts.{e}.up_proj.weight"] = fused[inner:].clone()
        elif name == "mlp.experts.down_proj":
            tensors |= {f"{at}mlp.experts.{e}.down_proj.weight": w.clone() for e, w in enumerate(value)}
        else:
            tensors[at + name] = value.clone()
    tensors[at + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[at + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return layer


@pytest.fixture(scope="module")
def mtp_model(hf_model, tmp_path_factory):
    path, model = hf_model
    out = tmp_path_factory.mktemp("mtp") / "hf"
    return out, model, with_an_mtp_layer(path, out, model)


def test_the_mtp_layer_reads_from_deepseek_s_files_and_predicts_as_transformers_mtp_layer(mtp_model):
    """titan's multi-token prediction loss on the layer read from the files against transformers' MtpLayer on the
    main model's final hidden states and the next tokens' embeddings, through the head: position i predicts the
    token two ahead."""
    folder, model, layer = mtp_model
    ours = titan_model(folder)
    assert ours.args.mtp_layers == 1
    seq = torch.randint(0, 320, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(5))
    inputs, labels = seq[:, :-1], seq[:, 1:]
    with torch.no_grad():
        ours(inputs, labels=labels)
        got = ours.step_losses()["mtp_loss"]  # the depths' mean summed loss, before mtp_loss_weight
        model.config._attn_implementation = "sdpa"  # causal without a mask
        h = model.model(inputs).last_hidden_state[:, :-1]  # the final normed states of the positions with a target
        positions = torch.arange(SEQ - 1)[None]
        rope = model.model.rotary_emb(h, positions)
        out = layer(model.model.embed_tokens(inputs[:, 1:]), h, rope, None, positions, None)
        want = torch.nn.functional.cross_entropy(
            model.lm_head(out).flatten(0, 1), seq[:, 2:].flatten(), reduction="sum"
        )
    assert want > 1
    assert abs(got - want) / want < 1e-6


def test_an_export_writes_the_mtp_layer_back_as_deepseek_s_files_hold_it(mtp_model, tmp_path):
    """hf -> titan -> hf through the command line: every tensor of the files, the MTP layer and its copies of the
    embedding and the head included, equal; transformers loads the export, the MTP layer aside (it keeps only a
    61-layer model's), and gives the original's logits."""
    from conftest import run_titan
    from helpers import read_checkpoint

    folder, model, _ = mtp_model
    for command in (("hf-to-dcp", folder, tmp_path / "dcp"), ("dcp-to-hf", tmp_path / "dcp", tmp_path / "hf")):
        result = run_titan("convert", *map(str, command))
        assert result.returncode == 0, result.stderr
    config, again = read_checkpoint(tmp_path / "hf")
    _, original = read_checkpoint(folder)
    assert again.keys() == original.keys() and any(name.startswith("model.layers.3.") for name in again)
    assert all(torch.equal(again[name], tensor) for name, tensor in original.items())
    assert config["num_nextn_predict_layers"] == 1
    exported, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert {name.split(".")[2] for name in info["unexpected_keys"]} == {"3"} and not info["missing_keys"]
    tokens = torch.randint(0, 320, (BATCH, SEQ), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert max_diff(exported.eval()(tokens).logits, model(tokens).logits) < TOL


def test_files_without_the_mtp_layer_their_config_names_read_without_it(hf_model, caplog):
    """transformers' save_pretrained writes num_nextn_predict_layers = 1 and no MTP layer: titan reads the model
    without it, and says so."""
    path, model = hf_model
    assert model.config.to_dict()["num_nextn_predict_layers"] == 1
    with caplog.at_level("INFO", logger="titan"):
        assert open_hf(path, SPEC).args.mtp_layers == 0
    assert (
        "names 1 multi-token prediction layer(s) (num_nextn_predict_layers) that its files do not hold" in caplog.text
    )


def test_an_mtp_layer_the_files_hold_in_part_is_one_line(mtp_model, tmp_path):

    folder, _, _ = mtp_model
    shutil.copytree(folder, tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    del tensors["model.layers.3.eh_proj.weight"]
    save_file(tensors, tmp_path / "hf" / "model.safetensors")
    with pytest.raises(ConfigError, match=r"missing \['model.layers.3.eh_proj.weight'\], unexpected \[\]"):
        open_hf(tmp_path / "hf", SPEC)
