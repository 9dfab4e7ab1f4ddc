"""`titan generate`: continue a prompt with the model of a titan checkpoint, greedily or by sampling.

The checkpoint, whatever layout saved it, is read into one process (hf_io.read_model_checkpoint); the tokenizer
is the one its recipe names, unless another is given. The prompt runs through the model in one forward (the
prefill), which fills a KV cache per layer; each further token then costs one forward of that token alone (the
decode), attending to the cache.
"""

from __future__ import annotations

import dataclasses
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from titan.checkpoint.checkpointer import read_train_state
from titan.checkpoint.hf import read_model_checkpoint
from titan.config import Tokenizer as TokenizerConfig
from titan.data.tokenizer import Tokenizer
from titan.errors import ConfigError


def load_model(checkpoint: Path, device: torch.device) -> tuple[Path, nn.Module]:
    """(the checkpoint folder found at `checkpoint`, its model in eval mode on `device`)."""
    path, spec, args, weights = read_model_checkpoint(checkpoint)
    with torch.device("meta"):
        model = spec.build(args)
    model.to_empty(device=device)
    model.init_weights(seed=0)  # for the RoPE table, a buffer no checkpoint holds; every parameter is replaced
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(weights[name])
    return path, model.eval()


def load_tokenizer(checkpoint: Path, vocab_size: int, path: Path | None = None) -> Tokenizer:
    """The tokenizer of the checkpoint's recipe, or the tokenizer.json at `path` with the recipe's BOS/EOS."""
    recipe = tomllib.loads(read_train_state(checkpoint)["recipe"])  # read_model_checkpoint has parsed it already
    try:
        cfg = TokenizerConfig(**recipe.get("tokenizer", {}))
    except TypeError as e:
        raise ConfigError(f"checkpoint {checkpoint}: its recipe's [tokenizer] is not titan's: {e}") from None
    if path is not None:
        cfg = dataclasses.replace(cfg, path=str(path))
    try:
        tokenizer = Tokenizer(cfg)
    except ConfigError as e:
        where = "--tokenizer" if path is not None else f"checkpoint {checkpoint}'s recipe (or pass --tokenizer)"
        raise ConfigError(f"{where}: {e}") from None
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(
            f"tokenizer {tokenizer.path} has {tokenizer.vocab_size} tokens but the model only {vocab_size}: "
            "not the tokenizer it was trained with"
        )
    return tokenizer


def check_options(max_new_tokens: int, temperature: float, top_k: int) -> None:
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ConfigError(f"--temperature must be >= 0 (0: greedy), got {temperature}")
    if top_k < 0:
        raise ConfigError(f"--top-k must be >= 0 (0: the whole vocabulary), got {top_k}")


def next_token(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator) -> torch.Tensor:
    """(batch,) tokens from the last position's logits (batch, vocab): the likeliest at temperature 0, else drawn
    from softmax(logits / temperature) over the top_k likeliest (0: every token)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    if top_k:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = (logits.float() / temperature).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@dataclass
class Generation:
    tokens: list[int]  # the new tokens, ending with end-of-text if the model ended the text
    prefill_seconds: float  # the prompt's forward, which gives the first new token
    decode_seconds: float  # the one-token forwards that give the rest

    @property
    def decode_tokens_per_second(self) -> float:
        return (len(self.tokens) - 1) / self.decode_seconds if self.decode_seconds else 0.0


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
    eos_id: int | None = None,
) -> Generation:
    """Continue `prompt` (token ids) by up to max_new_tokens, stopping after `eos_id`; sampling draws from a
    generator seeded with `seed`, so a run repeats on the same device."""
    check_options(max_new_tokens, temperature, top_k)
    args = model.args
    # Every token but the last new one goes through the model: a position and a cache slot each.
    length = len(prompt) + max_new_tokens - 1
    if length > args.max_seq_len:
        raise ConfigError(
            f"the prompt ({len(prompt)} tokens) and --max-new-tokens {max_new_tokens} need {length} positions, "
            f"more than the model's max_seq_len {args.max_seq_len}"
        )
    device = next(model.parameters()).device
    generator = torch.Generator(device).manual_seed(seed)
    cache = model.kv_cache(1, length)
    start = time.perf_counter()
    logits = model(torch.tensor([prompt], device=device), cache=cache)
    token = next_token(logits[:, -1], temperature, top_k, generator)
    tokens = [token.item()]  # .item() waits for the device, so the clock reads finished work
    decode_start = time.perf_counter()
    while len(tokens) < max_new_tokens and tokens[-1] != eos_id:
        logits = model(token[:, None], cache=cache)
        token = next_token(logits[:, -1], temperature, top_k, generator)
        tokens.append(token.item())
    return Generation(tokens, decode_start - start, time.perf_counter() - decode_start)


def continue_text(
    checkpoint: Path,
    prompt: str,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
    tokenizer_path: Path | None = None,
) -> tuple[str, Generation]:
    """The continuation of the text `prompt` by the model of a titan checkpoint (a step-N folder, or a
    checkpoints/ or run folder: its newest), on the GPU if there is one."""
    check_options(max_new_tokens, temperature, top_k)  # before the model loads, which may take long
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    path, model = load_model(checkpoint, device)
    tokenizer = load_tokenizer(path, model.args.vocab_size, tokenizer_path)
    # Training frames each document as BOS + text + EOS; a prompt is a document still going on.
    ids = tokenizer.encode(prompt)[:-1]
    generation = generate(model, ids, max_new_tokens, temperature, top_k, seed, tokenizer.eos_id)
    text = generation.tokens[:-1] if generation.tokens[-1] == tokenizer.eos_id else generation.tokens
    return tokenizer.decode(text), generation
