"""`titan generate`: continue prompts with the model of a titan checkpoint, greedily or by sampling.

Loading (load_model). The model is built on the meta device, where it takes no memory, in the dtype asked; its
buffers (the RoPE table) are computed without initialising a weight; then DCP reads the checkpoint a layer at a
time straight into the model's own parameters, casting on the way. The host holds the model and at most one saved
chunk besides: never a second copy, and never the model in fp32 when bf16 is asked. Under torchrun with --tp N
the model is first parallelised with its family's tensor-parallel plan, and each rank reads only its shard of
every tensor.

Decoding (generate, in titan/models/decoding.py, where the run's own benchmark tasks find it too): the prompts in one
forward that fills the KV cache, then one token per row and forward. The tokenizer is the one the checkpoint's
recipe names, unless another is given.
"""

from __future__ import annotations

import functools
import operator
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor.parallel import parallelize_module

from titan.checkpoint.hf import ModelCheckpoint, PeakMemory, checkpoint_tokenizer, load_tensors, open_model_checkpoint
from titan.checkpoint.train_state import model_buffers
from titan.dtypes import parse_dtype
from titan.errors import ConfigError
from titan.launcher import Launch

# Re-exported: the decoding is `titan generate`'s.
from titan.models.decoding import Generation, Sampling, check_options, generate, next_tokens  # noqa: F401

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


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
