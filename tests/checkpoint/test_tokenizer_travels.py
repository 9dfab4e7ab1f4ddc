"""An HF model's tokenizer travels with its weights: `titan convert hf-to-dcp` copies it beside them and its recipe
names the copy (with the BOS and EOS the HF tokenizer config says); `titan generate` and `titan convert dcp-to-hf`
read it from any folder; `checkpoint.init_from_hf` takes it into the run folder when the recipe names none.

The HF model is a tiny random Llama with a BPE tokenizer trained here, unlike the project's data/tokenizer.json
(other special tokens, other ids, 300 tokens rather than 1,170): a run that fell back to the project's would show.
"""

from __future__ import annotations

import json
import time
import tomllib

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import DEBUG_RECIPE, ROOT, run_titan, tiny_overrides  # noqa: E402
from helpers import assert_one_line_error, imported_modules, randomize_, tiny_hf_config  # noqa: E402
from titan.checkpoint.hf import TOKENIZER_FILES  # noqa: E402

TEXTS = ["The otter swims in the cold river.", "A heron waits by the reeds at dawn.", "Rain falls on the mill."] * 20
SAMPLES = ["The heron swims.", "  rain, at dawn\nby the mill", "é 🙂 unseen words"]
BOS, EOS = "<s>", "</s>"


def train_tokenizer(vocab_size: int):
    """A byte-level BPE with its own special tokens: <pad> 0, <s> 1, </s> 2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<pad>", BOS, EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TEXTS, trainer=trainer)
    return tok


def write_hf_folder(folder, vocab_size: int = 320, tokenizer_size: int = 300):
    """A tiny random Llama of `vocab_size` embedding rows, saved with a trained tokenizer as transformers saves it."""
    torch.manual_seed(0)
    config = tiny_hf_config(tied=False)
    config.vocab_size = vocab_size
    model = transformers.LlamaForCausalLM(config).float().eval()
    randomize_(model, seed=1)
    model.save_pretrained(folder)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(tokenizer_size), bos_token=BOS, eos_token=EOS
    )
    fast.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return write_hf_folder(tmp_path_factory.mktemp("hf") / "tiny-llama")


def ids(folder, texts=SAMPLES) -> list[list[int]]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


@pytest.mark.parametrize("where", ["root", "elsewhere"])
def test_hf_to_titan_to_hf_keeps_the_tokenizer(hf_dir, tmp_path, where):
    """From the repository root, where data/tokenizer.json is at hand, and from another folder, where it is not."""
    cwd = ROOT if where == "root" else tmp_path
    checkpoint, back = tmp_path / "dcp", tmp_path / "back"
    result = run_titan("convert", "hf-to-dcp", str(hf_dir), str(checkpoint), cwd=cwd)
    assert result.returncode == 0, result.stderr
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (checkpoint / name).read_bytes() == (hf_dir / name).read_bytes(), name
    assert f'path = "{checkpoint / "tokenizer.json"}"' in result.stdout and f'bos_token = "{BOS}"' in result.stdout

    result = run_titan("convert", "dcp-to-hf", str(checkpoint), str(back), cwd=cwd)
    assert result.returncode == 0, result.stderr
    assert f"from {checkpoint / 'tokenizer.json'}" in result.stdout
    assert set(TOKENIZER_FILES) <= {p.name for p in back.iterdir()}
    assert ids(back) == ids(hf_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(back)
    assert (theirs.bos_token, theirs.eos_token, theirs.bos_token_id) == (BOS, EOS, 1)
    assert json.loads((back / "config.json").read_text())["bos_token_id"] == 1


def test_generate_on_an_imported_checkpoint_reads_its_tokenizer_from_another_folder(hf_dir, tmp_path):
    checkpoint = tmp_path / "dcp"
    assert run_titan("convert", "hf-to-dcp", str(hf_dir), str(checkpoint), cwd=tmp_path).returncode == 0
    prompt = "The heron"
    generate = ["generate", "--checkpoint", str(checkpoint), "--prompt", prompt, "--max-new-tokens", "8"]
    result = run_titan(*generate, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    model = transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    prompt_ids = torch.tensor([[tokenizer.bos_token_id, *tokenizer(prompt, add_special_tokens=False)["input_ids"]]])
    with torch.no_grad():
        new = model.generate(prompt_ids, max_new_tokens=8, do_sample=False, eos_token_id=tokenizer.eos_token_id)
    continuation = tokenizer.decode(new[0, prompt_ids.shape[1] :], skip_special_tokens=True)
    assert len(set(new[0, prompt_ids.shape[1] :].tolist())) > 1 and result.stdout == continuation + "\n"


def model_overrides(hf_dir, tmp_path) -> list[str]:
    """The [model] of the recipe hf-to-dcp prints for `hf_dir`, as command-line overrides."""
    result = run_titan("convert", "hf-to-dcp", str(hf_dir), str(tmp_path / "for-its-recipe"))
    assert result.returncode == 0, result.stderr
    model = tomllib.loads(result.stdout[result.stdout.index("[model]") :].split("\n\n")[0])["model"]
    pairs = {"model.name": model["name"], "model.flavor": model["flavor"]}
    pairs |= {f"model.overrides.{key}": str(value).lower() for key, value in model.get("overrides", {}).items()}
    return [item for key, value in pairs.items() for item in (f"--{key}", value)]


def test_init_from_hf_takes_the_models_tokenizer_into_the_run_folder(hf_dir, tmp_path):
    """A recipe that names no tokenizer starts from the HF model's, copied into the run folder; its checkpoint
    names the copy, with which `titan generate` runs from another folder."""
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(DEBUG_RECIPE.read_text().replace('path = "titan:shakespeare"\n', ""))
    overrides = tiny_overrides(tmp_path, **{"training.steps": "1", "training.seq_len": "32"})
    del overrides[overrides.index("--tokenizer.path") : overrides.index("--tokenizer.path") + 2]
    args = [*overrides, *model_overrides(hf_dir, tmp_path), "--checkpoint.init_from_hf", str(hf_dir)]
    shown = run_titan("config", "show", "--config", str(recipe), *args)
    assert shown.returncode == 0, shown.stderr
    assert f'path = "{hf_dir / "tokenizer.json"}"' in shown.stdout and f'bos_token = "{BOS}"' in shown.stdout
    result = run_titan("train", "--config", str(recipe), *args)
    assert result.returncode == 0, result.stderr
    run = tmp_path / "debug"
    assert (run / "tokenizer" / "tokenizer.json").read_bytes() == (hf_dir / "tokenizer.json").read_bytes()
    saved = json.loads((run / "checkpoints" / "step-1" / "train_state.json").read_text())["recipe"]
    assert tomllib.loads(saved)["tokenizer"] == {
        "path": str(run / "tokenizer" / "tokenizer.json"), "bos_token": BOS, "eos_token": EOS
    }  # fmt: skip
    generate = ["generate", "--checkpoint", str(run), "--prompt", "The heron", "--max-new-tokens", "8"]
    generated = run_titan(*generate, cwd=tmp_path)
    assert generated.returncode == 0, generated.stderr
    assert generated.stdout == run_titan(*generate, "--tokenizer", str(hf_dir), cwd=tmp_path).stdout


def test_a_tokenizer_larger_than_the_embedding_is_refused_at_import(tmp_path):
    folder = write_hf_folder(tmp_path / "hf", vocab_size=272, tokenizer_size=300)
    assert_one_line_error(
        run_titan("convert", "hf-to-dcp", str(folder), str(tmp_path / "dcp")),
        "tokenizer.json has 300 tokens but the model's embedding only 272 rows",
    )
    assert not (tmp_path / "dcp").exists()


def test_init_from_hf_of_a_hub_model_not_in_the_cache_fails_at_once(tmp_path):
    """Before torch is imported (34 s before, after building the model): the import list shows it, where a time
    would vary with the machine's load (about 0.5 s on a quiet 2-core machine)."""
    start = time.perf_counter()
    result = run_titan("train", "--config", str(DEBUG_RECIPE), "--checkpoint.init_from_hf", "acme/not-downloaded",
                       env={"HF_HUB_CACHE": str(tmp_path), "PYTHONPROFILEIMPORTTIME": "1"})  # fmt: skip
    print(f"refused in {time.perf_counter() - start:.2f} s")
    assert_one_line_error(
        result, "checkpoint.init_from_hf: acme/not-downloaded", "titan download acme/not-downloaded --weights"
    )
    assert "titan.config" in imported_modules(result) and "torch" not in imported_modules(result)


def test_init_from_hf_takes_a_hub_model_from_the_local_cache(hf_dir, tmp_path, monkeypatch):
    """The HF cache's layout (models--owner--name/snapshots/<commit>, refs/main naming it), as titan download
    leaves it: the hub name reads that folder."""
    import huggingface_hub.constants

    from titan.hub import model_folder

    repo = tmp_path / "models--acme--tiny-llama"
    (repo / "snapshots").mkdir(parents=True)
    (repo / "snapshots" / "abc123").symlink_to(hf_dir)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    assert model_folder("acme/tiny-llama", "checkpoint.init_from_hf") == repo / "snapshots" / "abc123"
