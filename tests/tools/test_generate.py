"""`titan generate`: the KV cache against full forwards, greedy decoding against HF transformers' `generate`,
batches against each prompt alone, bf16 against fp32, tensor parallelism against one process, seeded sampling with
top-k and top-p against hand-computed distributions, and the command line.

One tiny run (dim 64, 2 layers) trains a few steps on the project's corpus and checkpoints; every test
generates from its checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
import torch

from conftest import ROOT, run_titan, run_titan_many
from distributed import free_port, run_distributed
from helpers import TOL, assert_one_line_error, full_weights, max_diff, trainer_for
from titan.checkpoint import hf as hf_io
from titan.checkpoint.hf import checkpoint_tokenizer
from titan.tools.generate import Loading, Sampling, continue_texts, generate, load_model, next_tokens

PROMPT = "The dog ran"
PROMPTS = ["The dog ran", "Once upon a time there was a little", "A cat"]  # 4, 9 and 3 tokens with BOS
NEW_TOKENS = 24
TOKENIZER = str(ROOT / "data" / "tokenizer.json")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(a run folder whose checkpoints/step-5 holds a model a few steps at a high learning rate trained, the
    trainer's weights at the end)."""
    root = tmp_path_factory.mktemp("generate")
    run = {"training.steps": "5", "lr_scheduler.warmup_steps": "0", "optimizer.lr": "1e-2", "checkpoint.enable": "true"}
    trainer = trainer_for(root, **run)
    trainer.train()
    return root / "debug", full_weights(trainer)


@pytest.fixture(scope="module")
def run_dir(trained):
    return trained[0]


@pytest.fixture(scope="module")
def checkpoint(run_dir):
    return run_dir / "checkpoints" / "step-5"


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_model(checkpoint, torch.device("cpu")).model


@pytest.fixture(scope="module")
def tokenizer(checkpoint, model):
    return checkpoint_tokenizer(checkpoint, model.args.vocab_size)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(text)[:-1] for text in PROMPTS]  # BOS + text, as continue_texts sends them


@pytest.fixture(scope="module")
def prompt(prompts) -> list[int]:
    return prompts[0]


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


def greedy(model, prompt: list[int], new_tokens: int = NEW_TOKENS, eos_id: int | None = None) -> list[int]:
    return generate(model, [prompt], new_tokens, eos_id=eos_id).tokens[0]


def test_cached_forwards_give_the_full_forward_logits(model, prompt):
    """The prompt in one forward, then one token at a time: the logits of one forward of the whole sequence."""
    tokens = torch.randint(0, model.args.vocab_size, (10,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        full = model(torch.tensor([prompt + tokens]))[0, len(prompt) - 1 : -1]
    assert full.abs().max() > 1 and max_diff(cached_logits(model, prompt, tokens), full) < TOL


def test_greedy_with_the_cache_equals_greedy_without(model, prompt):
    cached = greedy(model, prompt)
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
    assert greedy(model, prompt, eos_id=tokenizer.eos_id) == tokens
    # The tokens hardly depend on position in so short a training; the logits at each step do (an unshifted
    # RoPE in the decode moves them by ~1e-2).
    assert max_diff(cached_logits(model, prompt, tokens), torch.cat(theirs.logits)) < TOL


def test_a_batch_of_prompts_decodes_as_each_prompt_alone(model, prompts):
    """Left-padded to the longest, each row's prefill logits and greedy tokens are those of its prompt alone, and a
    row that ends (here: at a token chosen as end-of-text) stops there while the others go on."""
    assert len({len(p) for p in prompts}) == len(prompts)  # three paddings, one of them none
    alone = [greedy(model, p) for p in prompts]
    assert generate(model, prompts, NEW_TOKENS).tokens == alone
    longest = max(map(len, prompts))
    padded = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    cache = model.kv_cache(len(prompts), longest, torch.tensor([longest - len(p) for p in prompts]))
    with torch.no_grad():
        batched = model(padded, cache=cache)[:, -1]
    assert max_diff(batched, torch.stack([uncached_logits(model, p) for p in prompts])) < TOL
    eos = alone[0][5]  # the first row ends at its 6th token (or earlier, if that token came before)
    ended = [greedy(model, p, eos_id=eos) for p in prompts]
    assert len(ended[0]) <= 6 and max(map(len, ended)) == NEW_TOKENS
    assert generate(model, prompts, NEW_TOKENS, eos_id=eos).tokens == ended


def test_bf16_chooses_the_tokens_fp32_chooses(checkpoint, model, prompts):
    """bf16 loads every weight in bf16, and its top token is fp32's almost everywhere.

    Compared position by position on fp32's greedy continuations (teacher-forced: a free-running bf16 text that
    once took another token would be compared against a different context from then on). bf16 keeps 8 significant
    bits, so each value is rounded by up to 2^-9 relative, and the logits move by a few percent of their spread at
    most: a top token changes only where fp32's top two are that close. Measured here (3 prompts x 32 tokens): 95 of
    96 positions agree, the logits move by at most 2.7% of their standard deviation; on the debug flavor trained 150
    steps (dim 256, 4 layers), 94 of 96 and 1.9%, each disagreement at an fp32 margin under 1% of that deviation.
    """
    half = load_model(checkpoint, torch.device("cpu"), torch.bfloat16).model
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16} and half.rope.dtype == torch.float32
    agree = positions = 0
    for prompt in prompts:
        sequence = torch.tensor([prompt + greedy(model, prompt, 32)])
        with torch.no_grad():
            full, low = (m(sequence)[0, len(prompt) - 1 : -1].float() for m in (model, half))
        error = (full - low).abs().max().item()
        assert 1e-3 * full.std() < error < 0.05 * full.std()  # bf16 indeed, and within a few roundings
        agree += (full.argmax(-1) == low.argmax(-1)).sum().item()
        positions += len(full)
    assert agree >= 0.9 * positions, f"{agree} of {positions}"


def test_sampling_is_seeded_and_keeps_to_the_top_k(model, prompt):
    def sample(seed, top_k=0, temperature=1.0):
        return generate(model, [prompt], NEW_TOKENS, Sampling(temperature, top_k, seed=seed)).tokens[0]

    assert sample(seed=3) == sample(seed=3)
    assert sample(seed=3) != sample(seed=4)
    assert sample(seed=5, top_k=1, temperature=0.7) == greedy(model, prompt)
    tokens = sample(seed=6, top_k=3, temperature=2.0)  # hot: without the top-k cut, far more tokens would be drawn
    for i, token in enumerate(tokens):
        assert token in uncached_logits(model, prompt + tokens[:i]).topk(3).indices.tolist()


def test_top_p_near_zero_is_greedy(model, prompts):
    sampling = Sampling(temperature=1.5, top_p=1e-6, seed=1)  # hot, but the nucleus is the likeliest token alone
    assert generate(model, prompts, NEW_TOKENS, sampling).tokens == generate(model, prompts, NEW_TOKENS).tokens


@pytest.mark.parametrize(
    "top_p, nucleus, shares",
    [
        (0.7, [2, 1], [0.5 / 0.8, 0.3 / 0.8]),  # 0.5 < 0.7 <= 0.5 + 0.3: the token that crosses 0.7 is in
        (0.85, [2, 1, 3], [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95]),
        (0.4, [2], [1.0]),  # the likeliest token alone already holds more than 0.4
    ],
)
def test_top_p_draws_from_the_nucleus_in_its_proportions(top_p, nucleus, shares):
    """Probabilities 0.05, 0.3, 0.5, 0.15 (not in order, so the nucleus must be found by sorting); the nucleus is
    worked out by hand. 4000 draws per row, two rows (a batch samples each row on its own): every draw in the
    nucleus, each token's share within 5 standard deviations of its renormalised probability."""
    probs = torch.tensor([0.05, 0.3, 0.5, 0.15])
    logits = probs.log().expand(4000 * 2, 4)  # 4000 draws of two rows at once: rows 2i and 2i+1
    generator = torch.Generator().manual_seed(0)
    drawn = next_tokens(logits, Sampling(temperature=1.0, top_p=top_p), generator)
    assert set(drawn.tolist()) == set(nucleus)
    for token, share in zip(nucleus, shares):
        measured = (drawn == token).float().mean().item()
        assert abs(measured - share) <= 5 * (share * (1 - share) / len(drawn)) ** 0.5 + 1e-9, (token, measured)


@pytest.mark.slow
def test_loading_holds_the_model_and_one_layer_at_most(tmp_path):
    """The host memory `titan generate` adds while loading (its own report: the high-water mark of resident
    memory): the model in the asked dtype, plus one layer as saved (fp32, cast on the way), plus 24 MiB of lazily
    imported code and allocator slack. Reading every tensor first, as a whole state dict, then copying it into the
    model would add the model once more. Here (21M parameters: 80 MiB in fp32, a layer 12 MiB as saved) measured
    97 MiB in fp32 and 61 MiB in bf16; on a 104M-parameter model (dim 768, 16 layers; 396 MiB in fp32, a layer
    24 MiB), 416 MiB in fp32 and 226 MiB in bf16, against 819 MiB for a state dict copied into the model."""
    dims = {"model.overrides.dim": "512", "model.overrides.n_layers": "6", "model.overrides.n_heads": "8",
            "model.overrides.n_kv_heads": "4", "model.overrides.multiple_of": "256"}  # fmt: skip
    trainer = trainer_for(tmp_path, **dims, **{"training.steps": "1", "checkpoint.enable": "true"})
    trainer.train()
    model = trainer.model_parts.parts[0]
    layer = sum(p.numel() * 4 for p in model.layers["0"].parameters())
    for dtype, size in (("fp32", 4), ("bf16", 2)):
        result = run_titan(
            "generate", "--checkpoint", str(tmp_path / "debug"), "--prompt", PROMPT, "--max-new-tokens", "1",
            "--dtype", dtype,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        added = float(re.search(r"peak host memory added ([\d.]+) MiB", result.stderr).group(1)) * 2**20
        weights = sum(p.numel() for p in model.parameters()) * size
        assert weights > 40 * 2**20 and added < weights + layer + 24 * 2**20, (dtype, added / 2**20)


# -- tensor parallelism


def tp_run(checkpoint, prompts: list[list[int]]):
    """On each of 2 ranks: the shards it holds of three tensors, full-sequence logits and the greedy batch."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = load_model(checkpoint, torch.device("cpu"), tp_mesh=mesh).model
    shards = {
        name: dict(model.named_parameters())[name].to_local().clone()
        for name in ("tok_embeddings.weight", "layers.0.attention.wq.weight", "layers.1.feed_forward.w2.weight")
    }
    with torch.no_grad():
        logits = model(torch.tensor([prompts[1]]))[0]
    return shards, logits, generate(model, prompts, NEW_TOKENS, group=mesh.get_group()).tokens


@pytest.mark.distributed
def test_tensor_parallel_ranks_hold_their_shards_and_decode_as_one_process(checkpoint, model, prompts):
    results = run_distributed(tp_run, 2, checkpoint, prompts)
    full = dict(model.named_parameters())
    for rank, (shards, logits, tokens) in enumerate(results):
        # Embedding rows and column-parallel outputs split along dim 0, row-parallel inputs along dim 1.
        for (name, shard), dim in zip(shards.items(), (0, 0, 1)):
            assert torch.equal(shard, full[name].chunk(2, dim=dim)[rank]), (rank, name)
        with torch.no_grad():
            assert max_diff(logits, model(torch.tensor([prompts[1]]))[0]) < TOL
        assert tokens == generate(model, prompts, NEW_TOKENS).tokens


@pytest.mark.distributed
@pytest.mark.slow
def test_cli_under_torchrun_prints_what_one_process_prints(run_dir):
    args = ["--checkpoint", str(run_dir), "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--max-new-tokens", "8",
            "--temperature", "0.8", "--top-p", "0.9", "--seed", "2"]  # fmt: skip
    one = run_titan("generate", *args)
    torchrun = ["torchrun", "--nproc-per-node", "2", "--master-port", str(free_port()), "-m", "titan", "generate"]
    two = subprocess.run(
        [*torchrun, *args, "--tp", "2"], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    assert two.stdout == one.stdout and len(one.stdout.splitlines()) == 2
    assert "tp 2" in two.stderr and "tokens/s" in two.stderr


# -- the command line


def test_cli_prints_the_continuation_and_its_speed(run_dir):
    result = run_titan(
        "generate", "--checkpoint", str(run_dir), "--prompt", PROMPT, "--max-new-tokens", "12", "--tokenizer", TOKENIZER
    )
    assert result.returncode == 0, result.stderr
    texts, generation, _ = continue_texts(run_dir, [PROMPT], max_new_tokens=12)
    assert texts[0] and result.stdout == texts[0] + "\n"
    assert f"{len(generation.tokens[0])} tokens" in result.stderr and "tokens/s" in result.stderr
    assert "peak host memory added" in result.stderr


def test_cli_prints_a_json_line_per_prompt_of_a_file(run_dir, tmp_path):
    """Prompts from --prompt and a file (blank lines skipped), in batches of 2: one JSON line each, in order, with
    the text each prompt gets alone."""
    file = tmp_path / "prompts.txt"
    file.write_text(f"{PROMPTS[1]}\n\n{PROMPTS[2]}\n")
    result = run_titan(
        "generate", "--checkpoint", str(run_dir), "--prompt", PROMPTS[0], "--prompts-file", str(file),
        "--max-new-tokens", "10", "--batch-size", "2", "--dtype", "bf16",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line["prompt"] for line in lines] == PROMPTS
    alone = [continue_texts(run_dir, [text], 10, loading=Loading(dtype="bf16"))[0][0] for text in PROMPTS]
    assert [line["text"] for line in lines] == alone
    assert "bf16" in result.stderr and "3 prompts" in result.stderr


def test_cli_errors_are_one_line(run_dir, tmp_path):
    given = ["generate", "--checkpoint", str(run_dir), "--prompt", PROMPT]
    cases = [
        (["generate", "--checkpoint", str(tmp_path / "nope"), "--prompt", PROMPT], ["nope", "does not exist"]),
        (["generate", "--checkpoint", str(run_dir), "--prompt", ""], ["--prompt"]),
        (["generate", "--checkpoint", str(run_dir)], ["no prompt", "--prompts-file"]),
        (["generate", "--checkpoint", str(run_dir), "--prompts-file", str(tmp_path / "none.txt")], ["none.txt"]),
        ([*given, "--top-p", "0"], ["--top-p", "(0, 1]"]),
        ([*given, "--dtype", "fp16"], ["--dtype", "fp32, bf16"]),
        ([*given, "--tp", "2"], ["--tp 2", "torchrun --nproc-per-node 2"]),
        ([*given, "--max-new-tokens", "5000"], ["max_seq_len 2048"]),
    ]
    results = run_titan_many([(args, {}) for args, _ in cases])
    for (_, words), result in zip(cases, results):
        assert_one_line_error(result, *words)


def test_loading_sets_every_weight_and_never_initialises_them(trained, checkpoint, monkeypatch):
    """The loaded model holds the weights the trainer ended with, and loading never ran init_weights (on a big model
    it costs about as much as the load): the RoPE table comes from init_buffers."""
    from titan.models.llama.model import Transformer

    def refuse(*_):
        raise AssertionError("init_weights ran")

    monkeypatch.setattr(Transformer, "init_weights", refuse)
    weights = dict(load_model(checkpoint, torch.device("cpu")).model.named_parameters())
    assert weights.keys() == trained[1].keys()
    assert all(torch.equal(weights[name], value) for name, value in trained[1].items())


def test_cli_takes_torchs_dtype_names(run_dir):
    result = run_titan("generate", "--checkpoint", str(run_dir), "--prompt", PROMPT, "--max-new-tokens", "2",
                       "--dtype", "bfloat16")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "bf16" in result.stderr
