"""Rotary position embeddings: the table of Llama 3.1's scaled frequencies, the rotation of q and k in Meta's
interleaved layout, and each token's position within its document."""

from __future__ import annotations

import math

import torch

from titan.errors import ConfigError
from titan.models.decoder.args import DecoderArgs

# The most a RoPE table may take: a 128k-position Llama 3's is 64 MiB. A config of 2^24 positions and one head of
# 4,096 would ask for 256 GiB; a command builds the positions it runs (`titan generate`: its prompts' and tokens').
ROPE_MAX_BYTES = 4 << 30


def rope_frequencies(args: DecoderArgs) -> torch.Tensor:
    """Inverse frequencies per rotated pair, with Llama 3.1's smooth long-wavelength scaling or YaRN's."""
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, args.rope_dim, 2, dtype=torch.float64) / args.rope_dim))
    if args.rope_scaling_factor and args.rope_scaling == "yarn":
        return _yarn_frequencies(args, freqs)
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


def _yarn_frequencies(args: DecoderArgs, freqs: torch.Tensor) -> torch.Tensor:
    """YaRN (arXiv:2309.00071): the pairs that turn fewer than beta_slow times over the original context are
    interpolated (divided by the factor), those that turn more than beta_fast times kept, with a linear ramp between
    them over the pairs, its ends rounded outwards as transformers rounds them."""

    def pair_turning(rotations: float) -> float:  # the pair that turns this many times over the original context
        turns = math.log(args.rope_original_max_seq_len / (rotations * 2 * math.pi))
        return args.rope_dim * turns / (2 * math.log(args.rope_theta))

    low = max(math.floor(pair_turning(args.rope_yarn_beta_fast)), 0)
    high = min(math.ceil(pair_turning(args.rope_yarn_beta_slow)), args.rope_dim - 1)
    high = high if high != low else high + 0.001
    ramp = ((torch.arange(args.rope_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return freqs / args.rope_scaling_factor * ramp + freqs * (1 - ramp)


def rope_scale(args: DecoderArgs) -> float:
    """What multiplies cos and sin: YaRN's attention factor (its stated one, or 0.1 ln(factor) + 1), else 1."""
    if args.rope_scaling != "yarn" or not args.rope_scaling_factor:
        return 1.0
    if args.rope_attention_factor:
        return args.rope_attention_factor
    return 0.1 * math.log(args.rope_scaling_factor) + 1 if args.rope_scaling_factor > 1 else 1.0


def rope_table(args: DecoderArgs, device=None, positions: int | None = None) -> torch.Tensor:
    """(positions, head_dim/2, 2) table of cos and sin for the first `positions` (default and at most max_seq_len),
    refused in one line above ROPE_MAX_BYTES; computed in float64 a slice at a time, so the peak is the table's."""
    count = args.max_seq_len if positions is None else min(positions, args.max_seq_len)
    if torch.empty(0, device=device).is_meta:  # a model built on the meta device: the shape is all there is
        return torch.empty(count, args.rope_dim // 2, 2, device=device)
    size = count * args.rope_dim * 4
    if size > ROPE_MAX_BYTES:
        raise ConfigError(
            f"the RoPE table of {count:,} positions for heads of {args.rope_dim} would take {size / 2**30:,.0f} "
            f"GiB, more than titan builds ({ROPE_MAX_BYTES / 2**30:.0f} GiB): lower max_seq_len (the model's "
            "max_position_embeddings)"
        )
    table = torch.empty(count, args.rope_dim // 2, 2, device=device)
    frequencies, scale, step = rope_frequencies(args), rope_scale(args), 1 << 16
    for start in range(0, count, step):
        angles = torch.outer(torch.arange(start, min(start + step, count), dtype=torch.float64), frequencies)
        pairs = torch.stack([angles.cos(), angles.sin()], dim=-1)
        table[start : start + step] = (pairs if scale == 1 else pairs * scale).float().to(device)
    return table


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
