"""The Llama 3 model: published sizes, shapes, causality and seeded initialisation."""

import dataclasses

import pytest
import torch

from titan import models
from titan.models.decoder.attention import MaskForm, attend_flex, attend_per_document, document_mask, flex_length
from titan.models.decoder.rope import document_positions
from titan.models.llama import FLAVORS, Transformer, flops_per_token

# Meta's published parameter counts (Llama 3.2 1B/3B with tied embeddings; Llama 3.1 8B/70B/405B).
PUBLISHED_PARAMETERS = {
    "1B": 1_235_814_400,
    "3B": 3_212_749_824,
    "8B": 8_030_261_248,
    "70B": 70_553_706_496,
    "405B": 405_853_388_800,
}


@pytest.mark.parametrize("flavor", PUBLISHED_PARAMETERS)
def test_flavor_parameter_count_matches_the_published_count(flavor):
    with torch.device("meta"):  # no memory: even 405B is counted in milliseconds
        model = Transformer(FLAVORS[flavor])
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED_PARAMETERS[flavor]


@pytest.mark.parametrize(
    "family, flavor", [(family, flavor) for family in models._REGISTRY for flavor in models.family_flavors(family)]
)
def test_block_params_count_each_block_as_built(family, flavor):
    """The layer split sizes the blocks from their args without building the model (`titan config show` loads no
    torch): every block of every flavor, dense and MoE layers, with and without q/k norms, as the meta model has it."""
    spec = models.get_model_spec(family)
    args = spec.flavors[flavor]
    with torch.device("meta"):
        built = [sum(p.numel() for p in block.parameters()) for block in spec.blocks(spec.build(args))]
    blocks = args.n_layers + getattr(args, "mtp_layers", 0)  # a multi-token prediction module's block after them
    assert [args.block_params(layer) for layer in range(blocks)] == built


def test_the_layer_split_holds_each_block_at_its_own_size():
    """A pipeline's stage memory caps are held against each block's own weights, gradients and Adam moments (16
    bytes a parameter, as built on the meta device): DeepSeek-V3-16B's dense first layer is far lighter than its
    routed ones, which a split sized by the first block would pack several times too many of into a stage."""
    spec = models.get_model_spec("moe")
    args = spec.flavors["deepseek_v3_16b"]
    with torch.device("meta"):
        built = [sum(p.numel() for p in block.parameters()) for block in spec.blocks(spec.build(args))]
    blocks = models.model_blocks(args)
    assert blocks.gib == tuple(16 * n / 2**30 for n in built)
    assert blocks.gib[0] < blocks.gib[1] / 5


@pytest.mark.parametrize("flavor", PUBLISHED_PARAMETERS)
def test_flavor_output_shape_on_meta(flavor):
    with torch.device("meta"):
        model = Transformer(FLAVORS[flavor])
        logits = model(torch.zeros(2, 16, dtype=torch.long))
    assert logits.shape == (2, 16, FLAVORS[flavor].vocab_size)


def test_flops_per_token_is_six_per_matmul_weight_plus_attention():
    args = FLAVORS["8B"]
    with torch.device("meta"):
        model = Transformer(args)
    matmul_weights = sum(p.numel() for n, p in model.named_parameters() if p.ndim == 2 and n != "tok_embeddings.weight")
    assert flops_per_token(args, 8192) == 6 * matmul_weights + 12 * 32 * 4096 * 8192


def build(seed=0, **overrides):
    args = models.model_args("llama3", "debug", {"max_seq_len": 64, **overrides})
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model


def test_debug_forward_shape_and_causality():
    model = build(n_layers=2)
    tokens = torch.randint(0, 2048, (2, 32))
    logits = model(tokens)
    assert logits.shape == (2, 32, 2048) and torch.isfinite(logits).all()
    changed = tokens.clone()
    changed[:, 20] = (changed[:, 20] + 1) % 2048
    after = model(changed)
    assert torch.equal(logits[:, :20], after[:, :20])  # the past never sees the future
    assert not torch.allclose(logits[:, 20:], after[:, 20:])


def test_initialisation_is_a_function_of_the_seed():
    a, b, c = build(seed=1).state_dict(), build(seed=1).state_dict(), build(seed=2).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.attention.wq.weight"], c["layers.0.attention.wq.weight"])


def test_initialisation_scales():
    model = build()
    wq = model.layers["0"].attention.wq.weight
    assert abs(wq.std().item() - 0.02) < 0.002 and wq.abs().max() <= 0.06  # truncated at 3 std
    deep_wo = model.layers["3"].attention.wo.weight
    assert abs(deep_wo.std().item() - 0.02 / (2 * 4) ** 0.5) < 0.001  # residual projections shrink with depth
    assert torch.equal(model.norm.weight, torch.ones_like(model.norm.weight))


def test_tied_embeddings_share_one_parameter():
    model = build(tie_embeddings=True)
    assert model.output.weight is model.tok_embeddings.weight
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in build().parameters()) - 2048 * 256


@pytest.mark.parametrize("flavor", ["debug", "8B"])  # RoPE without and with Llama 3.1's frequency scaling
def test_init_buffers_completes_a_model_whose_weights_are_loaded(flavor):
    """titan generate computes the RoPE table, which no checkpoint holds, with init_buffers and loads every weight: the
    model must be the one init_weights builds, with no weight written first, and keep an fp32 table in bf16."""
    args = dataclasses.replace(
        FLAVORS[flavor], dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32, max_seq_len=256
    )
    reference = _initialised(args)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    untouched = {name: p.detach().clone() for name, p in model.named_parameters()}
    model.init_buffers()
    for name, param in model.named_parameters():  # as bits: memory to_empty leaves may hold NaNs
        assert torch.equal(param.detach().view(torch.int32), untouched[name].view(torch.int32)), name
    assert torch.equal(model.rope, reference.rope)
    model.load_state_dict(reference.state_dict())
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(tokens), reference(tokens))
    with torch.device("meta"):
        half = Transformer(args).to(torch.bfloat16)
    half.to_empty(device="cpu")
    half.init_buffers()
    assert half.tok_embeddings.weight.dtype == torch.bfloat16
    assert half.rope.dtype == torch.float32 and torch.equal(half.rope, reference.rope)


def test_unknown_override_is_rejected():
    with pytest.raises(ValueError, match="unknown model.overrides.n_layer"):
        models.model_args("llama3", "debug", {"n_layer": 2})
    with pytest.raises(ValueError, match="must be int"):
        models.model_args("llama3", "debug", {"n_layers": "two"})


def _small_model(traceable=False, **overrides):
    args = dataclasses.replace(
        FLAVORS["debug"], dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, **overrides
    )
    return _initialised(args, traceable)


def _initialised(args, traceable=False):
    with torch.device("meta"):
        model = Transformer(args, traceable)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    return model


def _packed(lengths: list[int], vocab=128, seed=0):
    """Documents of these lengths, packed into one row: tokens, positions, document ids, and each document alone."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(2, vocab, (n,), generator=g) for n in lengths]
    positions = torch.cat([torch.arange(n) for n in lengths])
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    return docs, torch.cat(docs)[None], positions[None], ids[None]


@pytest.mark.parametrize("path", ["per_document", "dense", "explicit"])
def test_document_masking_gives_each_document_the_loss_it_has_alone(path):
    explicit_attention = path == "explicit"
    # traceable (compiled blocks): SDPA with a dense boolean mask rather than attention per document.
    model = _small_model(traceable=path != "per_document", attn_dropout=0.1 if explicit_attention else 0.0)
    model.train(explicit_attention)  # attention dropout in training takes the explicit path instead of SDPA ...
    for layer in model.layers.values():
        layer.attention.dropout.forward = lambda x, rows: x  # ... here without dropping, to compare with SDPA
    docs, tokens, positions, ids = _packed([7, 19, 1, 12, 25])
    assert torch.equal(document_positions(ids), positions)  # what the model derives from the ids
    logits = model(tokens, None, ids)
    start = 0
    for doc in docs:
        alone = model(doc[None])
        torch.testing.assert_close(logits[:, start : start + len(doc)], alone, rtol=0, atol=1e-6)
        start += len(doc)
        if len(doc) == 1:
            continue
        packed_loss = torch.nn.functional.cross_entropy(logits[0, start - len(doc) : start - 1], doc[1:])
        alone_loss = torch.nn.functional.cross_entropy(alone[0, :-1], doc[1:])
        torch.testing.assert_close(packed_loss, alone_loss, rtol=1e-6, atol=0)
    # Without the mask the later documents see the earlier ones: the check above would fail.
    unmasked = model(tokens)
    assert (unmasked[:, 7:26] - logits[:, 7:26]).abs().max() > 1e-3


def test_document_mask_never_lets_a_token_attend_across_a_boundary():
    model = _small_model()
    _, tokens, positions, ids = _packed([5, 9, 3])
    mask = document_mask(ids, MaskForm.DENSE)[0, 0]
    for q in range(17):
        for k in range(17):
            assert bool(mask[q, k]) == (k <= q and int(ids[0, q]) == int(ids[0, k])), (q, k)
    # The CPU's per-document path attends within these spans only; padding added after them changes nothing.
    assert document_mask(ids, MaskForm.SPANS) == [[(0, 5, 0), (5, 14, 1), (14, 17, 2)]]
    padded = torch.cat([ids, torch.full((1, 4), -1)], dim=1)
    assert document_mask(padded, MaskForm.SPANS) == [[(0, 5, 0), (5, 14, 1), (14, 17, 2), (17, 21, -1)]]
    with_padding = model(torch.cat([tokens, torch.zeros(1, 4, dtype=tokens.dtype)], dim=1), None, padded)
    torch.testing.assert_close(with_padding[:, :17], model(tokens, None, ids), rtol=0, atol=1e-6)
    # Changing one document leaves every other document's logits unchanged.
    changed = tokens.clone()
    changed[0, 5:14] = (changed[0, 5:14] + 1) % 128
    before, after = model(tokens, None, ids), model(changed, None, ids)
    assert torch.equal(before[:, :5], after[:, :5]) and torch.equal(before[:, 14:], after[:, 14:])
    assert not torch.equal(before[:, 5:14], after[:, 5:14])


def test_flex_lengths_are_few_powers_of_two_from_its_block_size():
    assert [flex_length(n) for n in (1, 5, 128, 129, 300, 8192, 8193)] == [128, 128, 128, 256, 512, 8192, 16384]
    # Every length a packed micro-batch of up to 16,384 tokens can have compiles 8 kernels at most.
    assert sorted({flex_length(n) for n in range(1, 16385)}) == [2**i for i in range(7, 15)]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager is the CPU's reference
@pytest.mark.parametrize("seq", [5, 128, 130, 300])
def test_flex_attention_padded_to_its_length_bucket_equals_attention_per_document(seq):
    """The padding of attend_flex changes nothing: each document's tokens attend as per-document causal SDPA would
    (forward only: flex attention has no backward on the CPU; tests/cuda compares gradients)."""
    from torch.nn.attention.flex_attention import flex_attention

    generator = torch.Generator().manual_seed(seq)
    lengths = torch.randint(1, 60, (seq,), generator=generator).cumsum(0)
    ids = torch.searchsorted(lengths, torch.arange(seq), right=True)[None]  # documents of 1 to 59 tokens
    q = torch.randn(1, 4, seq, 16, generator=generator)
    k, v = (torch.randn(1, 2, seq, 16, generator=generator) for _ in range(2))
    flex = attend_flex(q, k, v, document_mask(ids, MaskForm.FLEX), attention=flex_attention)
    per_document = attend_per_document(q, k, v, document_mask(ids, MaskForm.SPANS))
    assert flex.shape == per_document.shape
    torch.testing.assert_close(flex, per_document, rtol=1e-5, atol=1e-5)


def test_the_rope_table_is_built_to_the_positions_a_command_runs_and_bounded():
    """A config of 2^24 positions and one head of 4,096 (a 1.3 MB HF folder) would ask for a 256 GiB table: refused
    in one line; the same model builds on the meta device, and a command that runs 100 positions (`titan generate`'s
    prompts and tokens) gets a table of 100, equal to the first 100 rows of the full one."""
    from titan.errors import ConfigError
    from titan.models.decoder.rope import rope_table
    from titan.models.llama.args import ModelArgs

    huge = ModelArgs(dim=4096, n_layers=1, n_heads=1, n_kv_heads=1, vocab_size=256, max_seq_len=2**24)
    with pytest.raises(
        ConfigError, match=r"the RoPE table of 16,777,216 positions for heads of 4096 would take 256 GiB"
    ):
        rope_table(huge)
    with torch.device("meta"):
        assert Transformer(huge).rope.shape == (2**24, 2048, 2)
    assert rope_table(huge, positions=100).shape == (100, 2048, 2)
    small = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=300_000)
    assert torch.equal(rope_table(small, positions=100), rope_table(small)[:100])  # computed a slice at a time
    assert torch.equal(rope_table(small)[70_000:70_100], rope_table(small, positions=70_100)[70_000:])
