"""Decoding through the model contract's KV cache: prompts of different lengths are left-padded into one batch (the
cache knows each row's padding, which nothing attends to and no position counts, so every row decodes as it would
alone); the prompts run in one forward (the prefill), then each further token costs a one-token forward per row.
`titan generate`, `titan eval` and the run's own benchmark tasks decode with it."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from titan.errors import ConfigError


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
    batch when every row has. group: the ranks that decode these prompts together (tensor-parallel shards, or a
    run's every rank in its eval tasks), which all take rank 0's tokens."""
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
