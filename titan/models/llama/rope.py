"""Rotary position embeddings: the table of Llama 3.1's scaled frequencies, the rotation of q and k in Meta's
interleaved layout, and each token's position within its document."""

from __future__ import annotations

import math

import torch

from titan.models.llama.args import ModelArgs


def rope_frequencies(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies per rotated pair, with Llama 3.1's smooth long-wavelength scaling."""
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float64) / args.head_dim))
    if args.rope_scaling_factor:
        low_wavelen = args.rope_original_max_seq_len / args.rope_low_freq_factor
        high_wavelen = args.rope_original_max_seq_len / args.rope_high_freq_factor
        wavelen = 2 * math.pi / freqs
        smooth = (args.rope_original_max_seq_len / wavelen - args.rope_low_freq_factor) / (
            args.rope_high_freq_factor - args.rope_low_freq_factor
        )
        blended = (1 - smooth) * freqs / args.rope_scaling_factor + smooth * freqs
        freqs = torch.where(wavelen > low_wavelen, freqs / args.rope_scaling_factor, freqs)
        in_between = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        freqs = torch.where(in_between, blended, freqs)
    return freqs


def rope_table(args: ModelArgs, device=None) -> torch.Tensor:
    """(max_seq_len, head_dim/2, 2) table of cos and sin."""
    positions = torch.arange(args.max_seq_len, dtype=torch.float64)
    angles = torch.outer(positions, rope_frequencies(args))
    return torch.stack([angles.cos(), angles.sin()], dim=-1).float().to(device)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of x: (batch, seq, heads, head_dim) by the angles of each
    token's position, rope: (batch or 1, seq or more, head_dim/2, 2), of which x takes the first seq."""
    rope = rope[:, : x.shape[1]]
    pairs = x.float().unflatten(-1, (-1, 2))
    cos, sin = rope[:, :, None, :, 0], rope[:, :, None, :, 1]
    real, imag = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([real * cos - imag * sin, real * sin + imag * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """Each token's position within its document: 0 where the id changes (and at the start), counting up.
    Derived from the ids, not passed along, so pipeline stages never index the RoPE table with anything but
    positions in [0, seq)."""
    index = torch.arange(document_ids.shape[1], device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return index - torch.where(starts, index, 0).cummax(dim=1).values
