"""Decoding's cache of each layer's keys and values, and the positions and mask of the tokens that follow the
cached ones."""

from __future__ import annotations

import torch


class KVCache:
    """One layer's keys and values of the tokens so far, for max_len tokens, so that decoding computes only the new
    token's and attends to every earlier one without recomputing it.

    Rows of a batch may hold prompts of different lengths, left-padded to one: row b's first pad[b] slots are padding,
    which no real token attends to, and its positions count from its first real token. The buffers are allocated on
    the first tokens, in their dtype, device and number of heads (a tensor-parallel rank holds a slice of them)."""

    def __init__(self, max_len: int, pad: torch.Tensor):
        self.max_len, self.pad = max_len, pad
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.length = 0  # slots filled: the slot of the next token

    def extend(self, k: torch.Tensor, v: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Store the new tokens' keys and values (batch, n_kv_heads, seq, head_dim) after the cached ones;
        returns those of every token so far. Values None: the keys hold them (latent attention's latent)."""
        if self.keys is None:
            self.keys = k.new_zeros(*k.shape[:2], self.max_len, k.shape[3])
            if v is not None:
                self.values = v.new_zeros(*v.shape[:2], self.max_len, v.shape[3])
        stop = self.length + k.shape[2]
        self.keys[:, :, self.length : stop] = k
        if v is not None:
            self.values[:, :, self.length : stop] = v
        self.length = stop
        return self.keys[:, :, :stop], None if v is None else self.values[:, :, :stop]


def cached_positions_and_mask(pad: torch.Tensor, start: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For `seq` new tokens in cache slots start.. of left-padded rows (pad: (batch,) slots of padding): their
    positions (batch, seq), counted from each row's first real token, and where they may attend (batch, 1, seq,
    start + seq): the earlier and same slots that are not padding. A padding slot attends to itself alone, so that
    its output (never read) stays finite: a row of nothing to attend to would give NaN, and NaN values times a zero
    probability are still NaN in the real tokens' attention."""
    slots = torch.arange(start, start + seq, device=pad.device)
    keys = torch.arange(start + seq, device=pad.device)
    mask = (keys <= slots[:, None]) & (keys >= pad[:, None, None])
    mask |= keys == slots[:, None]
    return (slots - pad[:, None]).clamp(min=0), mask.unsqueeze(1)
