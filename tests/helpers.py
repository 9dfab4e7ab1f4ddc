"""What the test folders share: documents in memory, the tiny model, the layout tests' tolerances and their
comparison with one process, full weights of a sharded model, runs stopped and resumed, a tiny HF Llama, and the
one-line-error check."""

from __future__ import annotations

import itertools
import json
import os
import queue
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import DEBUG_RECIPE, ROOT, tiny_overrides
from titan.config import load_config
from titan.data.order import block_documents, block_offsets
from titan.parallel.cp.blocks import BlockAttention, BlockKernel
from titan.parallel.cp.ring import GRAD_TAG, KV_TAG, ContextParallel, _Ring
from titan.rng.shards import full_tensor
from titan.run_plan import run_plan
from titan.tools.verify.comparison import FLOOR_MARGIN
from titan.train.step import StepHook
from titan.train.stop import Preempted
from titan.train.trainer import Trainer


class InMemoryDocuments:
    """The reader interface of PreparedDocuments (offsets, blocks, tokens) over token lists held in memory, plus
    each document's length."""

    def __init__(self, documents: list[list[int]]):
        self.documents = [np.asarray(d, dtype=np.int64) for d in documents]
        self.lengths = np.array([len(d) for d in documents], dtype=np.int64)
        self.n_documents = len(documents)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)
        self.block_documents = block_documents(self.n_documents)
        self.block_offsets = block_offsets(self.offsets, self.block_documents)

    def tokens(self, doc: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        return self.documents[doc][start:stop].copy()


def numbered_documents(n: int, seed: int = 0, min_len: int = 3, max_len: int = 40) -> InMemoryDocuments:
    """n documents of random lengths whose tokens name the document and the position: doc * 1000 + position."""
    lengths = np.random.default_rng(seed).integers(min_len, max_len, size=n)
    return InMemoryDocuments([[doc * 1000 + i for i in range(length)] for doc, length in enumerate(lengths)])


def full_weights(trainer) -> dict[str, torch.Tensor]:
    """Every parameter of this rank's model parts as a whole tensor."""
    return {n: full_tensor(p).detach().clone() for n, p in trainer.model_parts.named_parameters()}


def assert_one_line_error(result, *words: str) -> None:
    """A user error from the CLI: exit 2, no traceback, exactly one `error:` report, and one line of it holding
    every word (a recipe's several mistakes are reported together, a line each)."""
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("error: ")]
    assert len(starts) == 1, result.stderr
    report = [lines[starts[0]]] + list(
        itertools.takewhile(lambda line: line.startswith("  - "), lines[starts[0] + 1 :])
    )
    assert any(all(w in line for w in words) for line in report), (words, report)


def start_ranks(args: list[str], logs: list[Path], cores: list[int] | None = None) -> list[subprocess.Popen]:
    """`titan train ARGS` as len(logs) ranks started as torchrun starts them (RANK, WORLD_SIZE, MASTER_ADDR, ...),
    each rank's stderr to its log; with `cores`, rank r pinned to cores[r]."""
    from distributed import free_port

    world = len(logs)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}  # fmt: skip
    ranks = []
    for r, log in enumerate(logs):
        pin = (lambda r=r: os.sched_setaffinity(0, {cores[r]})) if cores else None
        with open(log, "w") as err:
            ranks.append(subprocess.Popen(
                [sys.executable, "-m", "titan", "train", "--config", str(DEBUG_RECIPE), *args], cwd=ROOT,
                env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.DEVNULL, stderr=err,
                preexec_fn=pin,
            ))  # fmt: skip
    return ranks


def imported_modules(result) -> set[str]:
    """The modules a CLI run imported, from its stderr under PYTHONPROFILEIMPORTTIME=1."""
    return {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time")}


def start_long_run(tmp_path) -> subprocess.Popen:
    """`titan train` of a run long enough to still be training when a test acts on it (few enough steps to end
    if it never does), returned once its first step is logged; its stderr is left to read."""
    overrides = tiny_overrides(tmp_path, **{**SMALL, "training.steps": "3000", "checkpoint.interval": "100000"})
    proc = subprocess.Popen(
        [sys.executable, "-m", "titan", "train", "--config", str(DEBUG_RECIPE), *overrides],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in proc.stderr:
        if re.search(r"step +1/3000", line):
            break
    return proc


def train_steps(trainer, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train `steps` steps on the trainer's own global batches; returns the losses and the full weights."""
    losses = trainer.train(until=trainer.step + steps)
    return losses, full_weights(trainer)


class GivenBatches(StepHook):
    """Steps on given global batches (each rank takes its micro-batches of them) instead of the loader's: see
    train_on_batches."""

    def step(self, step, batches, run):
        return run(micro_batches_of_rank(self.trainer, self.global_batches[step - self.first_step]))


def train_on_batches(trainer, global_batches: list) -> list[float]:
    """Train one step on each of the global batches (the trainer made with a GivenBatches hook); returns the
    losses."""
    hook = trainer.hook
    hook.trainer, hook.global_batches, hook.first_step = trainer, global_batches, trainer.step
    return trainer.train(until=trainer.step + len(global_batches))


def rows_of(batch, rows: slice):
    """Some rows of a batch, still counting the loss tokens of its whole step."""
    from titan.data import IGNORE, Batch

    pick = lambda t: None if t is None else t[rows]  # noqa: E731
    labels = batch.labels[rows]
    return Batch(
        batch.inputs[rows],
        labels,
        batch.rows[rows],
        pick(batch.document_ids),
        int((labels != IGNORE).sum()),
        batch.step_loss_tokens,
    )


def micro_batches_of_rank(trainer, global_batch) -> list:
    """The trainer's data-parallel rank's micro-batches of a global batch given whole."""
    dp_rank = trainer.rank_plan.dp_rank
    share, local = len(global_batch.rows) // trainer.layout.dp, trainer.rank_plan.micro_batches[0]
    return [rows_of(global_batch, slice(s, s + local)) for s in range(dp_rank * share, (dp_rank + 1) * share, local)]


# -- the tests' tiny model (the debug flavor shrunk: dim 64, 4 heads, 2 KV heads, 2 blocks), as recipe overrides

TINY_MODEL = {
    "model.overrides.dim": "64",
    "model.overrides.n_heads": "4",
    "model.overrides.n_kv_heads": "2",
    "model.overrides.n_layers": "2",
    "model.overrides.multiple_of": "32",
}


# -- the layout tests: each layout trains on its rows of the recipe's global batches

GLOBAL_BATCH, STEPS = 8, 5
MODEL = {
    **TINY_MODEL,
    "model.overrides.n_layers": "4",
    "training.seq_len": "32",
    "lr_scheduler.warmup_steps": "2",
    "optimizer.lr": "3e-3",
    # A held-out split, evaluated after training (train_on); the trainer itself would evaluate every 1000 steps.
    "validation.interval": "1000",
    "validation.fraction": "0.05",
    "validation.steps": "2",
}
# Tolerances, measured on this machine (fp32, 5 AdamW steps, every layout below): losses differ from the
# single process by at most 1.8e-7 relative and weights by at most 2.0e-6 absolute (TP's output head;
# reduce-scatters and split matmuls sum in other orders, and Adam's per-element normalisation magnifies
# rounding in near-zero gradients). Bounds: ~5x the measurement. A real bug is far outside: dropping FSDP's
# gradient-sum setting (gradients halved) moves the loss by 3.6e-6 and the weights by 6.8e-4.
LOSS_RTOL, PARAM_ATOL = 1e-6, 1e-5


def assert_matches_one_process(
    losses,
    reference,
    weights: dict | None = None,
    reference_weights: dict | None = None,
    *,
    floor: tuple[list, dict] | None = None,
    loss_rtol: float = LOSS_RTOL,
    param_atol: float = PARAM_ATOL,
    name: str | None = None,
) -> None:
    """A layout's losses against one process's, each within `loss_rtol` relative; with `weights`, its full weights
    too: the same parameter names, each element within `param_atol` absolute. `name` labels a failure.

    `floor` is the (losses, weights) of the one process trained again with every module's fp32 output moved by one ulp
    (titan.tools.verify.recording.add_rounding_noise): a bound rises to FLOOR_MARGIN times what that rounding alone
    moved, as titan verify's does. Adam divides a near-zero gradient's rounding by eps, so a few weights move by up
    to lr whatever their size, by an amount that depends on how the CPU's kernels order their sums (the
    latent-attention MoE's output head under TP2: 2.1e-5 on an Intel host, 8.5e-6 on an AMD EPYC); the floor shows
    as much on every machine."""
    label = lambda what: lambda found: f"{what}: {found}"  # noqa: E731  (keeps torch's account of the mismatch)
    if floor is not None:
        floor_losses, floor_weights = floor
        moved = max(abs(a - b) / abs(b) for a, b in zip(floor_losses, reference))
        loss_rtol = max(loss_rtol, FLOOR_MARGIN * moved)
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(reference), rtol=loss_rtol, atol=0, msg=label(f"{name}: losses")
    )
    if weights is None:
        return
    assert set(weights) == set(reference_weights), name
    for key, value in reference_weights.items():
        rounding = 0.0 if floor is None else float((floor_weights[key] - value).abs().max())
        atol = max(param_atol, FLOOR_MARGIN * rounding)
        torch.testing.assert_close(weights[key], value, rtol=0, atol=atol, msg=label(f"{name}: {key}"))


def layout_overrides(tmp, layout: dict) -> list[str]:
    return tiny_overrides(
        tmp, **{"metrics.log_freq": "100", **MODEL, "training.global_batch_size": str(GLOBAL_BATCH), **layout}
    )


def with_local_batch(layouts: dict, world: int) -> dict:
    """Fill in local_batch_size = global batch / data-parallel size where the layout does not set it."""
    result = {}
    for name, layout in layouts.items():
        dp = world // (int(layout.get("parallel.tp", 1)) * int(layout.get("parallel.pp", 1)))
        result[name] = {"training.local_batch_size": str(GLOBAL_BATCH // dp), **layout}
    return result


# DeepSeek's latent attention in the debug MoE (recipes/debug_moe.toml), as recipe overrides: a query latent of 24 and
# a key-value latent of 32, query and key heads of 16 + 8 rotated, value heads of 12.
LATENT_ATTENTION = {
    f"model.overrides.{name}": str(size)
    for name, size in (("q_lora_rank", 24), ("kv_lora_rank", 32), ("qk_nope_head_dim", 16), ("qk_rope_head_dim", 8),
                       ("v_head_dim", 12))
}  # fmt: skip


# -- runs stopped and resumed

SMALL = {
    **TINY_MODEL,
    "training.seq_len": "32",
    "training.steps": "10",
    "lr_scheduler.warmup_steps": "3",
    "optimizer.lr": "3e-3",
    "model.overrides.resid_dropout": "0.1",
}


# A run of 2 steps that saves its checkpoint at the end (the recipe's warmup would outlast it).
SAVED = {"training.steps": "2", "lr_scheduler.warmup_steps": "1"}


def trainer_for(run_root, hook: StepHook | None = None, **extra) -> Trainer:
    return Trainer(load_config(DEBUG_RECIPE, tiny_overrides(run_root, **{**SMALL, **extra})), hook)


def straight_and_resumed(root, extra: dict | None = None):
    extra = extra or {}
    straight = trainer_for(root / "straight", **extra)
    straight_losses = straight.train()
    first_losses = losses_until_preempted(root / "resumed", 5, **extra)
    second = trainer_for(root / "resumed", **extra)
    assert second.step == 5
    second_losses = second.train()
    return straight_losses, first_losses + second_losses, full_weights(straight), full_weights(second)


class StopAfter(StepHook):
    """Records each step's global loss, and requests a stop (as a SIGUSR1 would) after step `stop_after`."""

    def __init__(self, stop_after: int):
        self.stop_after, self.losses, self.trainer = stop_after, [], None

    def step(self, step, batches, run):
        local, norm = run(batches)
        trainer = self.trainer
        self.losses.append(trainer.stepper.global_loss(local.clone()).item())
        if step + 1 == self.stop_after:
            trainer.stop.request("SIGUSR1")  # what the signal handler does
            trainer.stop.next_vote = step + 1  # ranks vote about once a second; these steps are far shorter
        return local, norm


def losses_until_preempted(root, stop_after, **extra):
    hook = StopAfter(stop_after)
    hook.trainer = trainer_for(root, hook, **extra)
    with pytest.raises(Preempted, match=f"at step {stop_after}"):
        hook.trainer.train()
    return hook.losses


# -- a tiny random HF Llama (transformers is imported where it is used: most tests never need it)

# fp32 on CPU. Measured max |logit diff| (transformers 5.23, torch 2.13, |logits| up to ~2.9): 1.2e-6 for
# HF -> titan and 1.2e-6 for titan -> HF, tied or not. It is rounding only: with every computation forced to
# float64 on both sides (HF keeps RMSNorm, softmax and RoPE in float32 even in a float64 model, titan keeps
# RoPE in float32) the two models agree to 2e-14. The rounding grows fast with the weight scale (std 0.2:
# ~1e-5, each model ~1.3e-5 from a float64 reference), hence the modest scale in `randomize_`.
TOL = 1e-5


def tiny_hf_config(tied: bool):
    import transformers

    return transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=176,  # not titan's default for dim 64 (170): needs a computed ffn_dim_multiplier
        vocab_size=320,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        tie_word_embeddings=tied,
        attn_implementation="eager",  # an independent reference: titan uses SDPA
    )


def transformers_model(folder):
    """transformers' AutoModelForCausalLM of an HF folder in fp32, every tensor loaded and none left over."""
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    return model.eval()


def tiny_deepseek_v3(path: Path, vocab_size: int = 320, q_lora_rank: int | None = 24, tied: bool = False, **save):
    """A random transformers DeepseekV3ForCausalLM, saved at `path` (save_pretrained's keyword arguments in `save`):
    3 layers, the first dense, the others of 8 experts in 2 groups, 2 per token from the best group, with a shared
    expert and random routing biases; latent attention of 4 heads (queries 16 + 8 wide, values 12) from a 32-wide
    latent, and a 24-wide query latent unless q_lora_rank is None."""
    import transformers

    config = transformers.DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2,
        n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        tie_word_embeddings=tied, max_position_embeddings=64, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).float().eval()
    randomize_(model, seed=1)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(0.1 * torch.randn(8, generator=gen))
    model.save_pretrained(path, **save)
    return model


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that attention is far from uniform (so a q/k layout error shows) and norms not 1.

    HF's default init (std 0.02) makes attention nearly uniform, which would hide a q/k layout error; std 0.07
    moves the logits by ~0.5 without the permutation while keeping fp32 rounding ~8x under TOL (see above).
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied parameter is listed once
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.2 * noise if name.endswith("norm.weight") else 0.07 * noise)


def read_checkpoint(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    config = json.loads((path / "config.json").read_text())
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        weights.update(load_file(file))
    return config, weights


def hf_logits(path: Path, tokens: torch.Tensor) -> torch.Tensor:
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(
        path, local_files_only=True, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        return model(tokens).logits


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# -- the ring against full attention: inputs, the brute-force reference, and a ring of threads on one device


# (v's width, the scores' scale) of attention_inputs: values as wide as keys, and latent attention's, narrower with a
# scale of its own.
RING_WIDTHS = {"same_widths": (16, None), "narrow_values": (12, 0.2)}


def attention_inputs(cp: int, documents: bool, device="cpu", dtype=torch.float32, v_width: int = 16):
    """Seeded q (2 rows, 4 heads, 8·cp positions, head dim 16), k and v (2 kv heads; v the first `v_width` of 16),
    the weights of a loss on the output, and document ids of 1 to ~2 chunks of tokens, so that some documents meet
    across chunks and some pairs of chunks never do (None: one causal sequence). The same on every rank."""
    batch, heads, kv_heads, seq, head_dim = 2, 4, 2, 8 * cp, 16
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, seq, head_dim, generator=gen)
    k, v = (torch.randn(batch, kv_heads, seq, head_dim, generator=gen) for _ in range(2))
    weights = torch.randn(batch, heads, seq, head_dim, generator=gen)
    v, weights = v[..., :v_width], weights[..., :v_width]
    ids = torch.sort(torch.randint(0, 2 * cp + 1, (batch, seq), generator=gen), dim=1).values if documents else None
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return *(t.to(device, dtype) for t in (q, k, v, weights)), move(ids)


def cp_sequence(cp: int, seq: int, cp_rank: int) -> tuple[range, ...]:
    """The positions cp rank `cp_rank` holds of a sequence of `seq` tokens, by the run plan."""
    config = load_config(DEBUG_RECIPE, ["--parallel.cp", str(cp), "--training.seq_len", str(seq)], cp)
    return run_plan(config, cp).rank(cp_rank).sequence


def full_attention(q, k, v, documents, dropout=None, rows=None, scale=None):
    """Brute force on the whole sequence: every score (scaled by `scale`, None: 1/sqrt(q's width)), the causal (and
    document) mask, softmax, and dropout by the module as one process applies it to the probabilities."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    seq = q.shape[2]
    allowed = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    if documents is not None:
        allowed = (allowed & (documents[:, :, None] == documents[:, None, :]))[:, None]
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    if dropout is not None:
        probs = dropout(probs, rows)
    return probs @ v


class ThreadRing:
    """cp ranks as threads of one process, their exchanges through queues: a whole ring on one device, where a process
    group of several ranks cannot be had (NCCL takes one GPU per rank; gloo cannot send a rank to itself)."""

    def __init__(self, cp: int):
        self.cp = cp
        self.inboxes = {(r, tag): queue.Queue() for r in range(cp) for tag in (KV_TAG, GRAD_TAG)}

    def ring(self, cp_rank: int, seq: int, device) -> ContextParallel:
        sequence = cp_sequence(self.cp, seq, cp_rank)
        ring = ContextParallel(None, cp_rank, self.cp, sequence, seq, device)
        inboxes = self.inboxes

        def exchange(send, tag):
            inboxes[(cp_rank + 1) % self.cp, tag].put(send.clone())
            recv = torch.empty_like(send)
            return recv, [Arrival(recv, inboxes[cp_rank, tag])]

        ring.exchange = exchange
        return ring

    def attend(self, q, k, v, ids, grad_out, scale: float | None = None) -> tuple[torch.Tensor, ...]:
        """Every rank's output and q, k, v gradients (for a loss whose gradient on the output is `grad_out`), put
        back at their positions of the sequence, the scores scaled by `scale` (None: 1/sqrt(q's width)).

        Each thread calls the ring's forward and backward itself: autograd runs the CUDA nodes of every thread's
        backward on one thread per device, where one rank's backward would wait on a message from a rank queued
        behind it."""
        seq, rows = q.shape[2], torch.arange(q.shape[0], device=q.device)
        scale = q.shape[-1] ** -0.5 if scale is None else scale

        def run(cp_rank):
            ring = self.ring(cp_rank, seq, q.device)
            here, ctx = ring.positions, _Saved()
            blocks = BlockAttention(ring, ring.mask(ids), rows, None, q.shape[1] // k.shape[1], scale)
            out = _Ring.forward(ctx, *(t[:, :, here] for t in (q, k, v)), blocks)
            return here, out, *_Ring.backward(ctx, grad_out[:, :, here])[:3]

        results = [torch.empty_like(t) for t in (grad_out, q, k, v)]
        with ThreadPoolExecutor(self.cp) as pool:
            for here, *parts in pool.map(run, range(self.cp)):
                for whole, part in zip(results, parts):
                    whole[:, :, here] = part
        return tuple(results)


def record_kernels(monkeypatch) -> list[BlockKernel]:
    """The kernel of each block the ring computes from now on, forward and backward, in a list."""
    kernels, kernel = [], BlockAttention.kernel

    def recorded(self, *args):
        kernels.append(kernel(self, *args))
        return kernels[-1]

    monkeypatch.setattr(BlockAttention, "kernel", recorded)
    return kernels


class Arrival:
    """A tensor from the previous rank's thread, copied in when waited on."""

    def __init__(self, recv: torch.Tensor, inbox: queue.Queue):
        self.recv, self.inbox = recv, inbox

    def wait(self):
        self.recv.copy_(self.inbox.get(timeout=60))


class _Saved:
    """What autograd hands the ring's forward and backward: the tensors saved between them."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


# -- a tiny random HF Qwen3-MoE (test_hf_moe.py, test_convert_moe.py)

# fp32 on CPU, weights as randomize_ sets them. Measured max |logit diff| between titan's moe and transformers'
# Qwen3MoeForCausalLM (transformers 5.24, torch 2.13, |logits| up to ~2.4): 1.2e-6, with norm_topk_prob or
# without; each model is 1.2e-6 from titan run in float64, so it is rounding only. Routing or layout errors move
# the logits by 0.3 or more (norm_topk_prob ignored 0.32, a third expert per token 0.30, gate_proj and up_proj
# swapped 0.45, the q/k norm weights not moved with the RoPE rows 1.4), so TOL holds here too.


def tiny_qwen3_moe(path: Path, vocab_size: int = 320, norm_topk: bool = True, tied: bool = False, **save):
    """A random transformers Qwen3MoeForCausalLM, saved at `path` (save_pretrained's keyword arguments in `save`):
    3 layers, the first dense (mlp_only_layers), the others of 8 experts, 2 per token; 4 heads of 24 (wider than
    hidden_size / heads = 16) with q/k norms, and 2 KV heads."""
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        num_experts=8,
        num_experts_per_tok=2,
        mlp_only_layers=[0],
        norm_topk_prob=norm_topk,
        tie_word_embeddings=tied,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).float().eval()
    randomize_(model, seed=1)
    model.save_pretrained(path, **save)
    return model
