"""`titan generate`: continue prompts with the model of a titan checkpoint, greedily or by sampling.

Loading (load_model). The model is built on the meta device, where it takes no memory, in the dtype asked; its
buffers (the RoPE table) are computed without initialising a weight; then DCP reads the checkpoint a layer at a
time straight into the model's own parameters, casting on the way. The host holds the model and at most one saved
chunk besides: never a second copy, and never the model in fp32 when bf16 is asked. Under torchrun with --tp N
the model is first parallelised with its family's tensor-parallel plan, and each rank reads only its shard of
every tensor.

Decoding (generate). Prompts of different lengths are left-padded into one batch; the KV cache knows each row's
padding, which nothing attends to and no position counts, so every row decodes as it would alone. The prompts run
through the model in one forward (the prefill), which fills the cache; each further token costs one forward of
one token per row (the decode). The tokenizer is the one the checkpoint's recipe names, unless another is given.
"""

from __future__ import annotations

import functools
import math
import operator
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import parallelize_module

from titan.checkpoint.hf import ModelCheckpoint, PeakMemory, checkpoint_tokenizer, load_tensors, open_model_checkpoint
from titan.checkpoint.train_state import model_buffers
from titan.dtypes import parse_dtype
from titan.errors import ConfigError
from titan.launcher import Launch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen from the logits: the likeliest at temperature 0, else drawn from
    softmax(logits / temperature), cut to the top_k likeliest tokens, then to the nucleus of probability top_p."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no cut
    top_p: float = 1.0  # 1: no cut
    seed: int = 0  # of the generator the draws come from, so a run repeats on the same device

    def check(self) -> None:
        if not 0 <= self.temperature < math.inf:  # NaN too
            raise ConfigError(f"--temperature must be a finite number >= 0 (0: greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"--top-k must be >= 0 (0: the whole vocabulary), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p must be in (0, 1] (1: the whole vocabulary), got {self.top_p}")


def check_options(max_new_tokens: int, sampling: Sampling) -> None:
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    sampling.check()


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs (batch, vocab) with every token outside each row's nucleus set to 0: the nucleus is the likeliest
    tokens whose probabilities first reach top_p together (the one that reaches it included, so never empty)."""
    ordered, order = probs.sort(dim=-1, descending=True, stable=True)
    likelier = ordered.cumsum(dim=-1) - ordered  # the mass of the tokens before each
    return torch.zeros_like(probs).scatter(-1, order, ordered.masked_fill(likelier >= top_p, 0))


def next_tokens(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> torch.Tensor:
    """(batch,) tokens from the last position's logits (batch, vocab), as `sampling` says."""
    if sampling.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / sampling.temperature
    if sampling.top_k:
        kth = logits.topk(min(sampling.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    if sampling.top_p < 1:
        probs = nucleus(probs, sampling.top_p)  # multinomial takes unnormalised weights
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@dataclass
class Generation:
    tokens: list[list[int]]  # per prompt, the new tokens, ending with end-of-text if the model ended the text
    prefill_seconds: float  # the prompts' forwards, which give the first new tokens
    decode_seconds: float  # the one-token forwards that give the rest

    @property
    def decode_tokens_per_second(self) -> float:
        """New tokens after each row's first, per second of decoding: what a longer continuation costs."""
        decoded = sum(len(row) - 1 for row in self.tokens)
        return decoded / self.decode_seconds if self.decode_seconds else 0.0

    def __add__(self, other: Generation) -> Generation:  # the batches of one run, in order
        return Generation(
            self.tokens + other.tokens,
            self.prefill_seconds + other.prefill_seconds,
            self.decode_seconds + other.decode_seconds,
        )


@torch.no_grad()
def generate(
    model: nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    eos_id: int | None = None,
    group: dist.ProcessGroup | None = None,
) -> Generation:
    """Continue each prompt (token ids) by up to max_new_tokens, in one batch; a row stops after `eos_id`, the
    batch when every row has. group: the tensor-parallel ranks, which all take rank 0's tokens."""
    check_options(max_new_tokens, sampling)
    if not prompts or not all(prompts):
        raise ConfigError("every prompt needs at least one token")
    longest = max(map(len, prompts))
    # Every token but the last new one goes through the model: a position and a cache slot each.
    length = longest + max_new_tokens - 1
    if length > model.args.max_seq_len:
        raise ConfigError(
            f"the longest prompt ({longest} tokens) and --max-new-tokens {max_new_tokens} need {length} positions, "
            f"more than the model's max_seq_len {model.args.max_seq_len}"
        )
    device = next(model.parameters()).device
    generator = torch.Generator(device).manual_seed(sampling.seed)
    pad = [longest - len(prompt) for prompt in prompts]
    tokens = torch.tensor([[0] * n + prompt for n, prompt in zip(pad, prompts)], device=device)  # any id: unseen
    cache = model.kv_cache(len(prompts), length, torch.tensor(pad, device=device))

    def pick_after(tokens: torch.Tensor) -> torch.Tensor:
        """The next token of each row, after `tokens` (batch, seq) follow the cached ones."""
        token = next_tokens(model(tokens, cache=cache)[:, -1], sampling, generator)
        if group is not None:  # the ranks' logits agree, but a rank that drew otherwise would decode another text
            dist.broadcast(token, group_src=0, group=group)
        return token

    start = time.perf_counter()
    token = pick_after(tokens)
    rows = [[t] for t in token.tolist()]  # .tolist() waits for the device, so the clock reads finished work
    decode_start = time.perf_counter()
    for _ in range(max_new_tokens - 1):
        if all(eos_id in row for row in rows):
            break
        token = pick_after(token[:, None])
        for row, t in zip(rows, token.tolist()):
            row.append(t)
    decode_seconds = time.perf_counter() - decode_start
    ended = [row[: row.index(eos_id) + 1] if eos_id in row else row for row in rows]
    return Generation(ended, decode_start - start, decode_seconds)


# ---------------------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Loaded:
    """A checkpoint's model as load_model made it, and what loading took."""

    checkpoint: ModelCheckpoint
    model: nn.Module  # in eval mode, without gradients
    tp: int  # tensor-parallel shards
    seconds: float
    peak_host_memory: PeakMemory  # the most resident host memory loading added


def load_model(
    checkpoint: Path,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    tp_mesh=None,
    progress: bool = False,
    positions: int | None = None,
) -> Loaded:
    """The model of the titan checkpoint at `checkpoint` (a step-N folder, or a checkpoints/ or run folder: its
    newest) on `device`, its parameters in `dtype`; with tp_mesh (a 1-D DeviceMesh), this rank's tensor-parallel
    shard of it. progress: a bar on stderr while it loads (after the first second). positions: the most the command
    runs, which the RoPE table covers (Model.init_buffers)."""
    start = time.perf_counter()
    rank, world, group = (tp_mesh.get_local_rank(), tp_mesh.size(), tp_mesh.get_group()) if tp_mesh else (0, 1, None)
    # Opened first: its checks import the model family's code, which is not what loading the weights adds.
    found = open_model_checkpoint(checkpoint, rank, world, group)
    spec, args = found.spec, found.args
    with PeakMemory() as peak:
        with torch.device("meta"):
            model = spec.build(args).to(dtype)
        if tp_mesh is not None:
            try:
                args.check_parallelism(world, 1)
            except ValueError as e:
                raise ConfigError(f"--tp {world}: {e}") from None
            parallelize_module(model, tp_mesh, spec.tp_plan(model, sequence_parallel=False, loss_parallel=False))
        model.to_empty(device=device)
        model.init_buffers(positions)
        model.requires_grad_(False)
        for param in model.parameters():
            param.zero_()  # were an element ever left unread, it would not be stale process memory
        load_weights(found, model, progress)
    return Loaded(found, model.eval(), world, time.perf_counter() - start, peak)


def load_weights(found: ModelCheckpoint, model: nn.Module, progress: bool = False) -> None:
    """Fill the model's parameters (plain, or a rank's DTensor shards) and its buffers that are state (a MoE's
    routing biases) from the checkpoint, one block (the family's unit, a layer for Llama) at a time, then the
    parameters outside blocks (embedding, final norm, head)."""
    from tqdm import tqdm

    params = {**dict(model.named_parameters()), **model_buffers(model)}
    names = {id(param): name for name, param in params.items()}
    groups = [
        [names[id(t)] for t in (*block.parameters(), *block.buffers()) if id(t) in names]
        for block in found.spec.blocks(model)
    ]
    in_blocks = {name for group in groups for name in group}
    groups.append([name for name in params if name not in in_blocks])

    def saved_bytes(name: str) -> int:
        shape, dtype = found.saved[name]
        return torch.Size(shape).numel() * dtype.itemsize

    bar = tqdm(
        total=sum(map(saved_bytes, params)),
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=sys.stderr,
        disable=not progress,
        desc=f"loading {found.path.name}",
        delay=1,  # nothing for a model loaded within a second
    )
    with bar:
        for group in groups:
            load_tensors(found.path, {name: params[name] for name in group})
            bar.update(sum(map(saved_bytes, group)))


def device_and_mesh(tp: int):
    """(this process's device, the tensor-parallel mesh or None): one process, or one per shard under torchrun,
    each on its GPU (LOCAL_RANK) if there are GPUs, else on the CPU (gloo)."""
    from titan.parallel.mesh import init_distributed

    world = Launch.from_env().world
    if tp < 1:
        raise ConfigError(f"--tp must be >= 1, got {tp}")
    if world != tp:
        fix = (
            f"pass --tp {world} to split the model over them"
            if tp == 1
            else f"start it with `torchrun --nproc-per-node {tp} -m titan generate ... --tp {tp}`"
        )
        raise ConfigError(f"--tp {tp} takes {tp} processes, one per shard, but {world} were started: {fix}")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", Launch.from_env().local_rank) if cuda else torch.device("cpu")
    if tp == 1:
        return device, None
    from torch.distributed.device_mesh import init_device_mesh

    init_distributed("auto", device)
    return device, init_device_mesh(device.type, (tp,), mesh_dim_names=("tp",))


@dataclass(frozen=True)
class Loading:
    """How a checkpoint's model is loaded: its dtype (a key of DTYPES, or torch's name for it), split over `tp`
    processes, with a progress bar or not."""

    dtype: str = "fp32"
    tp: int = 1
    progress: bool = False


def continue_texts(
    checkpoint: Path,
    prompts: list[str],
    max_new_tokens: int = 64,
    sampling: Sampling = Sampling(),
    tokenizer_path: Path | None = None,
    loading: Loading = Loading(),
    batch_size: int = 0,
) -> tuple[list[str], Generation, Loaded]:
    """The continuation of each text in `prompts` by the model of a titan checkpoint, on the GPU if there is one,
    in batches of batch_size prompts (0: all in one)."""
    check_options(max_new_tokens, sampling)  # before the model loads, which may take long
    dtype = DTYPES[parse_dtype(loading.dtype, DTYPES)]
    if batch_size < 0:
        raise ConfigError(f"--batch-size must be >= 0 (0: every prompt in one batch), got {batch_size}")
    device, mesh = device_and_mesh(loading.tp)
    loaded = load_model(checkpoint, device, dtype, mesh, loading.progress, positions=1)
    tokenizer = checkpoint_tokenizer(loaded.checkpoint.path, loaded.model.args.vocab_size, tokenizer_path)
    # Training frames each document as BOS + text + EOS; a prompt is a document still going on.
    ids = [tokenizer.encode(prompt)[:-1] for prompt in prompts]
    loaded.model.init_buffers(positions=max(map(len, ids)) + max_new_tokens)  # the positions this run takes
    size = batch_size or len(ids)
    group = mesh.get_group() if mesh is not None else None
    batches = [ids[i : i + size] for i in range(0, len(ids), size)]
    generation = functools.reduce(
        operator.add, [generate(loaded.model, b, max_new_tokens, sampling, tokenizer.eos_id, group) for b in batches]
    )
    texts = [tokenizer.decode(row[:-1] if row[-1] == tokenizer.eos_id else row) for row in generation.tokens]
    return texts, generation, loaded


def report(loaded: Loaded, generation: Generation) -> str:
    """Two lines for stderr: what was loaded, how fast and with how much host memory; what was generated, how fast."""
    params = sum(p.numel() for p in loaded.model.parameters())  # a DTensor counts its whole tensor
    dtype = next(k for k, v in DTYPES.items() if v == next(loaded.model.parameters()).dtype)
    tp = f", tp {loaded.tp}" if loaded.tp > 1 else ""
    prompts, new = len(generation.tokens), sum(map(len, generation.tokens))
    return (
        f"loaded {loaded.checkpoint.path} ({params / 1e6:,.1f}M parameters, {dtype}{tp}) in {loaded.seconds:.2f} s, "
        f"peak host memory added {loaded.peak_host_memory}{' on rank 0' if tp else ''}\n"
        f"{new} tokens for {prompts} prompt{'s' * (prompts > 1)}: prefill {generation.prefill_seconds:.3f} s, decode "
        f"{new - prompts} tokens in {generation.decode_seconds:.3f} s ({generation.decode_tokens_per_second:,.1f} "
        "tokens/s)"
    )
