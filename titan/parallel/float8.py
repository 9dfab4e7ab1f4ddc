"""Float8 training through torchao: the transformer blocks' linear layers compute in float8.

`convert_to_float8_training` swaps the chosen `nn.Linear`s for torchao's `Float8Linear`, which casts its
input, weight and output gradient to float8 with dynamic scales and multiplies them with `torch._scaled_mm`;
the parameters themselves stay in fp32 (bf16 mixed precision only casts the compute copy), so optimizer
state, checkpoints and HF exports are exactly those of the unconverted model, with the same names.

Order, in titan/parallel/parallelize.py: convert the meta model first, then TP (torchao's float8 TP styles,
tensorwise only), activation checkpointing, compile and FSDP (float8 all-gather of the weights, tensorwise
only). After each optimizer step the trainer calls `precompute_scales`, which computes the scales of the
next float8 all-gather for all weights in one all-reduce.

torchao is imported only when float8 is on: it is slow to import and logs warnings about its CUDA kernels.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.distributed as dist
from torch import nn

from titan.config import Config, Layout
from titan.errors import ConfigError, import_extra
from titan.run_plan import precision

log = logging.getLogger("titan")

# torch._scaled_mm on CUDA needs float8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell (10.0+).
MIN_CUDA_CAPABILITY = (8, 9)
# cuBLAS float8 matmuls need both dimensions of the weight to be multiples of 16.
MULTIPLE = 16


def _torchao():
    """torchao.float8, imported quietly (it warns about CUDA kernels it cannot load on this machine)."""
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in quiet]
    try:
        for logger in quiet:
            logger.setLevel(logging.ERROR)
        float8 = import_extra("torchao.float8", "float8", "float8.enable")
        import torchao.float8.float8_tensor_parallel  # noqa: F401  (the float8 TP styles)
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)
    return float8


def check_float8(
    config: Config,
    layout: Layout,
    device: torch.device,
    spec=None,
    args=None,
    capability: tuple[int, int] | None = None,
) -> None:
    """Refuse float8 where it cannot run, before any work. With the model's `spec` and `args`, also refuse a
    filter that converts nothing. `capability` stands in for the GPU's (for tests)."""
    f8 = config.float8
    if not f8.enable:
        return
    _torchao()  # installed, or one line naming the extra
    if device.type == "cuda":
        if capability is None:
            capability = torch.cuda.get_device_capability(device)
        if tuple(capability) < MIN_CUDA_CAPABILITY:
            name = torch.cuda.get_device_name(device) if torch.cuda.is_available() else "this GPU"
            raise ConfigError(
                "float8.enable needs float8 matmuls, i.e. a GPU of compute capability "
                f"{MIN_CUDA_CAPABILITY[0]}.{MIN_CUDA_CAPABILITY[1]} "
                f"or newer (Ada, Hopper, Blackwell); {name} has {capability[0]}.{capability[1]}; set float8.enable "
                "= false"
            )
    elif device.type != "cpu":
        raise ConfigError(
            f"float8.enable runs on CUDA GPUs (compute capability 8.9+) and the CPU, not on {device.type}"
        )
    if device.type == "cpu" and f8.recipe == "rowwise_with_gw_hp" and precision(config, layout).autocast:
        # Without FSDP, bf16 is autocast; torchao 0.18's Float8Linear follows CUDA autocast only, so on the CPU its
        # high-precision weight-gradient matmul meets an fp32 input and a bf16 gradient and fails.
        raise ConfigError(
            "float8.recipe = 'rowwise_with_gw_hp' with training.mixed_precision = 'bf16' fails on the CPU without FSDP "
            "(torchao keeps the weight gradient's input in fp32 under CPU autocast); use mixed_precision = 'fp32', "
            "another float8.recipe, or FSDP (parallel.dp_shard > 1)"
        )
    if spec is not None:
        with torch.device("meta"):
            model = spec.build(args)
        keep = module_filter(model, spec.blocks(model), config, layout.tp)
        if not any(keep(module, name) for name, module in model.named_modules()):
            multiple = f"{MULTIPLE} x parallel.tp = {MULTIPLE * layout.tp}" if layout.tp > 1 else str(MULTIPLE)
            raise ConfigError(
                "float8.enable converts no linear layer: none in the transformer blocks has in and out features "
                "that are "
                f"multiples of {multiple} and a name free of float8.skip {config.float8.skip}"
            )


def module_filter(model: nn.Module, blocks: list[nn.Module], config: Config, tp: int = 1):
    """The `module_filter_fn` for torchao: a linear inside a transformer block, not named by float8.skip,
    whose in and out features are multiples of 16 (of 16 x tp under tensor parallelism, so every shard is)."""
    block_ids = {id(b) for b in blocks}
    prefixes = tuple(f"{name}." for name, module in model.named_modules() if id(module) in block_ids)
    skip, multiple = tuple(config.float8.skip), MULTIPLE * tp

    def convert(module: nn.Module, fqn: str) -> bool:
        return (
            isinstance(module, nn.Linear)
            and fqn.startswith(prefixes)
            and not any(s in fqn for s in skip)
            and module.in_features % multiple == 0
            and module.out_features % multiple == 0
        )

    return convert


def linear_config(config: Config, fsdp: bool, device: torch.device | None = None):
    """torchao's Float8LinearConfig for the recipe; float8 all-gather only where FSDP shards the weights. On the
    CPU, torchao's emulation (an fp32 product of the float8 values and their scales): a CPU has no float8 matmul,
    and torch._scaled_mm's oneDNN kernel on an Intel CPU with AMX took 34 ms for a 256 x 64 x 64 product, 230 times
    its fallback's, with the same result. A plan's trace (no device) keeps the GPU's torch._scaled_mm."""
    f8 = config.float8
    linear = _torchao().Float8LinearConfig.from_recipe_name(f8.recipe)
    if f8.enable_fsdp_float8_all_gather and fsdp:
        linear = dataclasses.replace(linear, enable_fsdp_float8_all_gather=True)
    if device is not None and device.type == "cpu":
        linear = dataclasses.replace(linear, emulate=True)
    return linear


def convert(
    model: nn.Module, blocks: list[nn.Module], config: Config, layout: Layout, device: torch.device | None = None
) -> list[str]:
    """Swap the chosen linears of `model` (on the meta device, before any parallelism, for `device`) for
    Float8Linear. Returns the names of the converted linears."""
    if not config.float8.enable:
        return []
    float8 = _torchao()
    keep = module_filter(model, blocks, config, layout.tp)
    chosen = [name for name, module in model.named_modules() if keep(module, name)]
    float8.convert_to_float8_training(model, module_filter_fn=keep, config=linear_config(config, layout.dp > 1, device))
    skipped = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and name not in chosen]
    log.info(
        "float8 (%s recipe): %d linear layers converted; left in high precision: %s",
        config.float8.recipe,
        len(chosen),
        ", ".join(skipped) or "none",
    )
    return chosen


def is_float8_linear(module: nn.Module) -> bool:
    from torchao.float8.float8_linear import Float8Linear

    return isinstance(module, Float8Linear)


def tp_styles(blocks: list[nn.Module], config: Config, tp_mesh):
    """(colwise, rowwise, prepare_module_input) style classes for the blocks' TP plan, or None for torch's own.

    torchao's float8 TP styles cast activations to float8 before their all-gathers (and gradients before
    their reduce-scatters); they need the tensorwise recipe, every linear of the blocks in float8, and, with
    sequence parallelism, a backend that can all-gather float8 tensors (NCCL; gloo cannot). Otherwise the
    float8 linears run under torch's plain styles: float8 matmuls on each shard, collectives in high
    precision, as torchtitan does for the rowwise recipes."""
    if not config.float8.enable:
        return None
    linears = [m for block in blocks for m in block.modules() if isinstance(m, nn.Linear)]
    why = (
        "the float8.recipe is not tensorwise"
        if config.float8.recipe != "tensorwise"
        else "some block linears stay in high precision"
        if not all(is_float8_linear(m) for m in linears)
        else "gloo cannot all-gather the float8 activations of sequence parallelism"
        if config.parallel.sequence_parallel and dist.get_backend(tp_mesh.get_group()) == "gloo"
        else ""
    )
    if why:
        log.info("float8 with tensor parallelism: torch's TP styles, collectives in high precision (%s)", why)
        return None
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput


def precomputes_scales(config: Config, layout: Layout) -> bool:
    """Whether each optimizer step ends by computing the next forward's float8 all-gather scales: with float8
    all-gather and float8.precompute_dynamic_scale, under FSDP."""
    f8 = config.float8
    return f8.enable and f8.enable_fsdp_float8_all_gather and f8.precompute_dynamic_scale and layout.dp > 1


@torch.no_grad()
def precompute_scales(parts: list[nn.Module]) -> None:
    """The scales of the next forward's float8 all-gathers, for every FSDP-sharded weight in one all-reduce
    (instead of one per weight)."""
    precompute = _torchao().precompute_float8_dynamic_scale_for_fsdp
    for part in parts:
        precompute(part)
