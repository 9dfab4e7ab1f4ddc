"""QK-clip on one process: each attention module's recorded maxima against the logits materialised here from the q
and k it attends with (every mask form), the clip against gamma computed by hand on a hand-built GQA and latent
attention, a trainer's step whose clipped heads' logits on the same inputs end at tau while the others' weights stay
bitwise those of an unclipped run, a bitwise resume, and `titan plan`'s count of the extra FLOPs (the layouts:
tests/parallel/test_qk_clip_layouts.py)."""

import dataclasses
import json

import pytest
import torch

from conftest import DEBUG_RECIPE
from helpers import full_weights, straight_and_resumed, trainer_for
from titan.config import load_config
from titan.models.decoder import attention as gqa
from titan.models.decoder import latent_attention as mla
from titan.models.decoder.rope import rope_table
from titan.models.llama.args import ModelArgs
from titan.models.moe import FLAVORS
from titan.optim.qk_clip import HeadMax, QKClip
from titan.train.model import resolve_model

# Measured: the recorded and logged maxima at most 1.5e-7 relative off the float64 logits, the clipped heads' new
# maxima 2.0e-7 off tau, the clipped rows 1.2e-7 off the hand's gamma (fp32 rounding); bounds ~50x and ~8x (1e-6).
RTOL = 1e-5


@pytest.fixture
def logits(monkeypatch):
    """Each attention module's logits, materialised from the q and k it attends with, in float64, as the list
    `calls[module]` of (batch, heads, seq, seq) with -inf where the mask (None: causal, or document spans) forbids."""
    calls: dict[torch.nn.Module, list[torch.Tensor]] = {}

    def recording(attend):
        def wrapped(module, q, k, v, mask, rows, scale=None):
            k_all = k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            scores = q.double() @ k_all.mT * (q.shape[-1] ** -0.5 if scale is None else scale)
            seq = q.shape[2]
            allowed = torch.zeros(q.shape[0], 1, seq, seq, dtype=torch.bool)
            for row, spans in enumerate(mask if mask is not None else [[(0, seq, 0)]] * q.shape[0]):
                for start, stop, _ in spans:
                    allowed[row, :, start:stop, start:stop] = torch.ones(stop - start, stop - start).tril().bool()
            calls.setdefault(module, []).append(scores.masked_fill(~allowed, float("-inf")))
            return attend(module, q, k, v, mask, rows, scale)

        return wrapped

    monkeypatch.setattr(gqa, "attend", recording(gqa.attend))
    monkeypatch.setattr(mla, "attend", recording(mla.attend))
    return calls


def per_head_max(calls: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([scores.amax(dim=(0, 2, 3)) for scores in calls]).amax(0)


def test_every_mask_form_gives_the_largest_logits_of_the_attended_pairs():
    """Flex's block mask (GPUs; built here on the CPU), the dense mask and the document spans: the same maxima as the
    logits materialised under the documents' causal mask, and over a 600-token row (two blocks of queries)."""
    ids = torch.tensor([[0] * 5 + [1] * 7 + [2] * 8, [3] * 20])
    q, k = torch.randn(2, 4, 20, 8), torch.randn(2, 2, 20, 8)
    scores = q.double() @ k.double().repeat_interleave(2, dim=1).mT * 8**-0.5
    allowed = (ids[:, :, None] == ids[:, None, :]) & torch.ones(20, 20, dtype=torch.bool).tril()
    want = scores.masked_fill(~allowed[:, None], float("-inf")).amax(dim=(0, 2, 3))
    for form in gqa.MaskForm:
        assert torch.allclose(gqa.head_max(q, k, gqa.document_mask(ids, form), None).double(), want, rtol=RTOL), form
    q, k = torch.randn(1, 2, 600, 8), torch.randn(1, 2, 600, 8)
    want = (q @ k.mT * 8**-0.5).masked_fill(~torch.ones(600, 600, dtype=torch.bool).tril(), float("-inf"))
    assert torch.allclose(gqa.head_max(q, k, None, None), want.amax(dim=(0, 2, 3)), rtol=RTOL)


def hand_built(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gqa":
        args = ModelArgs(dim=32, n_heads=4, n_kv_heads=2, n_layers=1, vocab_size=16, max_seq_len=16)
        module = gqa.Attention(args)
    else:
        mla_args = {"kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6}
        args = dataclasses.replace(FLAVORS["debug"], dim=32, n_heads=4, max_seq_len=16, q_lora_rank=0, **mla_args)
        module = mla.LatentAttention(args)
    for p in module.parameters():
        if p.ndim == 2:
            torch.nn.init.normal_(p, std=0.3)
    module.rope_args = args
    return module.train()


def expected_rows(kind: str, module, gamma: torch.Tensor) -> dict[str, torch.Tensor]:
    """The row scales of the hand computation: GQA's query rows by gamma; MLA's (K2) non-rope query and key rows by
    sqrt(gamma), rope query rows by gamma, value rows as they are."""
    rows = {}
    for g in gamma.tolist():
        if kind == "gqa":
            rows.setdefault("wq.weight", []).extend([g] * module.head_dim)
        else:
            rows.setdefault("wq.weight", []).extend([g**0.5] * module.nope + [g] * module.rope)
            rows.setdefault("wkv_b.weight", []).extend([g**0.5] * module.nope + [1.0] * module.v_width)
    return {name: torch.tensor(values) for name, values in rows.items()}


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_the_clip_scales_the_heads_above_tau_by_the_hand_computed_gamma(kind, logits):
    module = hand_built(kind)
    x, rope, rows = torch.randn(2, 12, 32), rope_table(module.rope_args)[None], torch.arange(2)
    clip = QKClip(tau=0.0, names=("attention",), heads=4)
    module.logit_max = HeadMax(0, 0)
    with torch.no_grad():
        module(x, rope, rows, None)
    brute = per_head_max(logits[module])
    assert torch.allclose(module.logit_max.value.double(), brute, rtol=RTOL)
    tau = brute.sort().values[1:3].mean().item()  # two heads above, two below
    clip = dataclasses.replace(clip, tau=tau)
    before = {name: p.detach().clone() for name, p in module.named_parameters()}
    # A step skipped for a non-finite gradient norm logs its largest logits and clips nothing.
    recorded = module.logit_max.value
    skipped = clip.after_step([module], applied=torch.tensor(False))
    assert skipped["qk_max/layer0"].item() == recorded.max().item()
    assert all(torch.equal(p, before[name]) for name, p in module.named_parameters())
    module.logit_max.value = recorded  # the applied step's record: the same forward
    metrics = clip.after_step([module], applied=torch.tensor(True))
    assert abs(metrics["qk_max/layer0"].item() - brute.max().item()) <= RTOL * brute.max().item()
    gamma = torch.where(brute > tau, tau / brute, 1.0)
    scaled = expected_rows(kind, module, gamma)
    for name, p in module.named_parameters():
        if name in scaled:
            assert torch.allclose(p, before[name] * scaled[name][:, None].float(), rtol=1e-6, atol=0), name
            untouched = scaled[name] == 1.0
            assert torch.equal(p[untouched], before[name][untouched]), name
        else:
            assert torch.equal(p, before[name]), name
    logits.clear()
    with torch.no_grad():
        module(x, rope, rows, None)
    after = per_head_max(logits[module])
    assert (after <= tau * (1 + RTOL)).all()
    assert torch.allclose(after[brute > tau], torch.full_like(after[brute > tau], tau), rtol=RTOL)
    assert torch.equal(after[brute <= tau], brute[brute <= tau])


def logged(run_root) -> dict:
    (metrics,) = run_root.glob("*/metrics.jsonl")
    return json.loads(metrics.read_text().splitlines()[0])


def test_a_trained_step_clips_its_heads_to_tau_and_logs_the_largest_logits(tmp_path, logits):
    """Muon's step without the clip (tau far above) and with it (tau among the heads' maxima): the clipped heads'
    query rows differ by gamma, every other weight is bitwise the unclipped run's, and each layer's logits on its
    inputs of the step, from the new weights, end at most tau. At a negligible lr: the update moves the logits too,
    by ~0.5% here at the recipe's (the clip bounds the logits it measured, before the update)."""
    run = {"optimizer.name": "muon", "optimizer.lr": "1e-7", "model.overrides.resid_dropout": "0",
           "checkpoint.enable": "false"}  # fmt: skip
    loose = trainer_for(tmp_path / "loose", **run, **{"optimizer.qk_clip_tau": "1e9"})
    loose.train(until=1)
    attentions = [m for m in loose.model_parts.parts[0].modules() if hasattr(m, "qk_clip_scales")]
    brute = torch.stack([per_head_max(logits[m]) for m in attentions])  # (layers, heads)
    for i, layer in enumerate(brute):
        assert abs(logged(tmp_path / "loose")[f"qk_max/layer{i}"] - layer.max().item()) <= RTOL * layer.max().item()
    tau = brute.flatten().median().item()
    assert (brute > tau).any() and (brute <= tau).any()
    strict = trainer_for(tmp_path / "strict", **run, **{"optimizer.qk_clip_tau": str(tau)})
    inputs = {}  # each attention module's inputs of the step
    for m in strict.model_parts.parts[0].modules():
        if hasattr(m, "qk_clip_scales"):
            m.register_forward_pre_hook(lambda m, args, kwargs: inputs.setdefault(m, (args, kwargs)), with_kwargs=True)
    strict.train(until=1)
    unclipped, clipped = full_weights(loose), full_weights(strict)
    head_dim = attentions[0].head_dim
    for name, weight in clipped.items():
        layer = int(name.split(".")[1]) if name.endswith("attention.wq.weight") else None
        if layer is None:
            assert torch.equal(weight, unclipped[name]), name
            continue
        gamma = torch.where(brute[layer] > tau, tau / brute[layer], 1.0).repeat_interleave(head_dim)
        assert torch.allclose(weight, unclipped[name] * gamma[:, None].float(), rtol=1e-6, atol=0), name
        assert torch.equal(weight[gamma == 1], unclipped[name][gamma == 1]), name
    logits.clear()
    with torch.no_grad():
        for module, (args, kwargs) in inputs.items():
            module(*args, **kwargs)
    after = torch.stack([per_head_max(logits[m]) for m in inputs])
    assert (after <= tau * (1 + RTOL)).all()
    assert torch.allclose(after[brute > tau], torch.full_like(after[brute > tau], tau), rtol=RTOL)


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_a_clipped_run_resumes_bitwise(tmp_path, optimizer):
    """The clip is a function of each step's weights and batches: the checkpoint holds nothing more for it. AdamW
    takes the clip as Muon does (it acts on the weights after the update)."""
    run = {"optimizer.name": optimizer, "optimizer.qk_clip_tau": "0.1"}  # the tiny model's heads start at 0.11-0.14
    straight, resumed, weights_straight, weights_resumed = straight_and_resumed(tmp_path, run)
    assert straight == resumed
    assert all(torch.equal(weights_resumed[name], value) for name, value in weights_straight.items())
    (metrics,) = (tmp_path / "straight").glob("*/metrics.jsonl")
    assert any(value > 0.1 for line in metrics.read_text().splitlines() for key, value in json.loads(line).items()
               if key.startswith("qk_max/")), "the run never clipped"  # fmt: skip


def test_titan_plan_counts_the_logits_computed_again():
    """Each row's (seq, seq) scores of every head and layer, once more: 2 seq^2 head_dim FLOPs (no document mask)."""
    from titan.train.estimate.estimate import estimate_step

    flops = {}
    for tau in ("0", "100"):
        config = load_config(DEBUG_RECIPE, ["--optimizer.qk_clip_tau", tau, "--data.document_mask", "false"])
        flops[tau] = estimate_step(config, 1).ranks[0].flops
    args, t = resolve_model(config).args, config.training
    scores = t.local_batch_size * args.n_heads * 2 * t.seq_len**2 * args.head_dim
    assert flops["100"] - flops["0"] == args.n_layers * scores
