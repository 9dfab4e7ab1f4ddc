"""`titan generate`: the KV cache against full forwards, greedy decoding against HF transformers' `generate`,
seeded sampling, and the command line.

One tiny run (dim 64, 2 layers) trains a few steps on the project's corpus and checkpoints; every test
generates from its checkpoint.
"""

from __future__ import annotations

import pytest
import torch

from conftest import ROOT, run_titan
from helpers import TOL, assert_one_line_error, max_diff, trainer_for
from titan.checkpoint import hf as hf_io
from titan.tools.generate import continue_text, generate, load_model, load_tokenizer

PROMPT = "The dog ran"
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run folder whose checkpoints/step-5 holds a model a few steps at a high learning rate trained."""
    root = tmp_path_factory.mktemp("generate")
    run = {"training.steps": "5", "lr_scheduler.warmup_steps": "0", "optimizer.lr": "1e-2", "checkpoint.enable": "true"}
    trainer_for(root, **run).train()
    return root / "debug"


@pytest.fixture(scope="module")
def checkpoint(run_dir):
    return run_dir / "checkpoints" / "step-5"


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_model(checkpoint, torch.device("cpu"))[1]


@pytest.fixture(scope="module")
def tokenizer(checkpoint, model):
    return load_tokenizer(checkpoint, model.args.vocab_size)


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    return tokenizer.encode(PROMPT)[:-1]  # BOS + text, as continue_text sends it


def uncached_logits(model, tokens: list[int]) -> torch.Tensor:
    """The last position's logits from a forward of the whole sequence, no cache."""
    with torch.no_grad():
        return model(torch.tensor([tokens]))[0, -1]


def cached_logits(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """(len(tokens), vocab): the logits that gave each of `tokens`, from the prompt's forward and then one
    forward of each token but the last, through a KV cache."""
    cache = model.kv_cache(1, len(prompt) + len(tokens))
    with torch.no_grad():
        logits = [model(torch.tensor([prompt]), cache=cache)[0, -1]]
        logits += [model(torch.tensor([[t]]), cache=cache)[0, -1] for t in tokens[:-1]]
    return torch.stack(logits)


def test_cached_forwards_give_the_full_forward_logits(model, prompt):
    """The prompt in one forward, then one token at a time: the logits of one forward of the whole sequence."""
    tokens = torch.randint(0, model.args.vocab_size, (10,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        full = model(torch.tensor([prompt + tokens]))[0, len(prompt) - 1 : -1]
    assert full.abs().max() > 1 and max_diff(cached_logits(model, prompt, tokens), full) < TOL


def test_greedy_with_the_cache_equals_greedy_without(model, prompt):
    cached = generate(model, prompt, NEW_TOKENS).tokens
    tokens = list(prompt)
    for _ in range(NEW_TOKENS):
        tokens.append(uncached_logits(model, tokens).argmax().item())
    assert cached == tokens[len(prompt) :]
    assert len(set(cached)) > 3  # a continuation, not one token repeated


def test_greedy_equals_hf_generate(checkpoint, model, tokenizer, prompt, tmp_path):
    transformers = pytest.importorskip("transformers")
    hf_io.dcp_to_hf(checkpoint, tmp_path / "hf")
    hf = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path / "hf", local_files_only=True, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    inputs = torch.tensor([prompt])
    with torch.no_grad():
        theirs = hf.generate(
            inputs,
            attention_mask=torch.ones_like(inputs),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=tokenizer.eos_id,
            pad_token_id=tokenizer.eos_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = theirs.sequences[0, len(prompt) :].tolist()
    assert generate(model, prompt, NEW_TOKENS, eos_id=tokenizer.eos_id).tokens == tokens
    # The tokens hardly depend on position in so short a training; the logits at each step do (an unshifted
    # RoPE in the decode moves them by ~1e-2).
    assert max_diff(cached_logits(model, prompt, tokens), torch.cat(theirs.logits)) < TOL


def test_sampling_is_seeded_and_keeps_to_the_top_k(model, prompt):
    sample = lambda seed, top_k=0, temperature=1.0: generate(model, prompt, NEW_TOKENS, temperature, top_k, seed).tokens
    assert sample(seed=3) == sample(seed=3)
    assert sample(seed=3) != sample(seed=4)
    assert sample(seed=5, top_k=1, temperature=0.7) == generate(model, prompt, NEW_TOKENS).tokens
    tokens = sample(seed=6, top_k=3, temperature=2.0)  # hot: without the top-k cut, far more tokens would be drawn
    for i, token in enumerate(tokens):
        assert token in uncached_logits(model, prompt + tokens[:i]).topk(3).indices.tolist()


def test_cli_prints_the_continuation_and_its_speed(run_dir):
    result = run_titan(
        "generate", "--checkpoint", str(run_dir), "--prompt", PROMPT, "--max-new-tokens", "12",
        "--tokenizer", str(ROOT / "data" / "tokenizer.json"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    text, generation = continue_text(run_dir, PROMPT, max_new_tokens=12)
    assert text and result.stdout == text + "\n"
    assert f"{len(generation.tokens)} tokens" in result.stderr and "tokens/s" in result.stderr


def test_cli_errors_are_one_line(run_dir, tmp_path):
    assert_one_line_error(
        run_titan("generate", "--checkpoint", str(tmp_path / "nope"), "--prompt", PROMPT), "nope", "does not exist"
    )
    assert_one_line_error(run_titan("generate", "--checkpoint", str(run_dir), "--prompt", ""), "--prompt")
