"""What both of the MoE family's Hugging Face formats (Qwen3-MoE's and DeepSeek-V3's) share: each routed expert as
three linears in the files (`mlp.experts.{e}.gate_proj.weight`, ...), as transformers' save_pretrained writes them.
titan's experts.w1 is the E gate_proj stacked on dim 0 (a stacked source: a shard reads only its experts' tensors)."""

from __future__ import annotations

import re

_EXPERT = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}  # each expert's linears, as Llama's MLP's
# An expert's tensor in the files: the layer and the expert's index.
_EXPERT_NAME = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")


def expert_names(n_experts: int) -> dict[str, tuple[str, ...]]:
    """titan name -> the HF names of the tensors each stacked expert tensor holds, within a layer."""
    return {
        f"feed_forward.experts.{titan}": tuple(f"mlp.experts.{e}.{hf}.weight" for e in range(n_experts))
        for titan, hf in _EXPERT.items()
    }


def check_experts(names: set[str], n_experts: int, field: str) -> None:
    """ValueError when the files hold experts in another form or number than the config's `field` says."""
    fused = sorted(name for name in names if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")))
    if fused:
        raise ValueError(
            f"{fused[0]}: experts fused into one tensor are not read; titan reads each expert's gate_proj, up_proj "
            "and down_proj, as transformers' save_pretrained writes them"
        )
    held: dict[int, int] = {}
    for name in names:
        match = _EXPERT_NAME.match(name)
        if match:
            layer, expert = int(match[1]), int(match[2])
            held[layer] = max(held.get(layer, 0), expert + 1)
    for layer, count in sorted(held.items()):
        if count != n_experts:
            raise ValueError(
                f"model.layers.{layer}.mlp holds {count} experts, but {field} in config.json is {n_experts}"
            )
