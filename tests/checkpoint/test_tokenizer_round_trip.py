"""HF tokenizer -> titan -> HF keeps how text is tokenised, for both kinds of tokenizer people bring: one that
prepends a BOS (Llama 3's) and one that has none (Qwen's: text + EOS). titan frames documents and prompts as the
original does, and the exported tokenizer encodes every text as the original did."""

import json

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors

from conftest import ROOT
from titan.checkpoint.hf import write_tokenizer_files
from titan.checkpoint.hf.files import hf_tokenizer
from titan.data.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
TEXTS = ["Once upon a time", "the cat sat on the mat.\nIt looked at the sun.", "  spaces  and\ttabs ", "é ☃ 😀"]
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def hf_folder(tmp_path, kind: str):
    """The project's tokenizer as an HF folder: Llama 3's kind (a post-processor prepends BOS; the config names it)
    or Qwen's (no BOS: the config's bos_token is null)."""
    folder = tmp_path / kind
    folder.mkdir()
    tokenizer = HFTokenizer.from_file(str(ROOT / "data" / "tokenizer.json"))
    if kind == "llama":
        bos_id = tokenizer.token_to_id(BOS)
        tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, bos_id)])
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS if kind == "llama" else None,
              "eos_token": EOS}  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("kind", ["llama", "qwen"])
def test_a_tokenizer_keeps_its_framing_through_titan_and_back(tmp_path, kind):
    folder = hf_folder(tmp_path, kind)
    original = transformers.AutoTokenizer.from_pretrained(folder)
    ours = Tokenizer(hf_tokenizer(folder))
    assert (ours.bos_id is None) == (kind == "qwen")  # no BOS taken from elsewhere (the EOS, before)
    for text in TEXTS:
        theirs = original(text)["input_ids"]
        assert ours.encode(text) == [*theirs, ours.eos_id]  # a document: the original's encoding, then EOS
        assert ours.encode(text)[:-1] == theirs  # a prompt, as generate feeds it
    exported = tmp_path / "exported"
    exported.mkdir()
    write_tokenizer_files(exported, ours, 2048)
    again = transformers.AutoTokenizer.from_pretrained(exported)
    for text in TEXTS:
        assert again(text)["input_ids"] == original(text)["input_ids"], text
        assert again.decode(again(text)["input_ids"], skip_special_tokens=True) == text


def test_hf_weights_with_another_tokenizer_are_refused_unless_the_recipe_says_so(tmp_path):
    """checkpoint.init_from_hf's weights learned what their tokenizer's ids mean: a recipe naming another
    tokenizer.path is refused in one line, trains with checkpoint.allow_other_tokenizer, and one naming the
    folder's own tokenizer (or none) is left as it is."""
    from conftest import DEBUG_RECIPE
    from titan.checkpoint.weights_tokenizer import with_weights_tokenizer
    from titan.config import load_config
    from titan.errors import ConfigError

    folder = hf_folder(tmp_path, "qwen")
    other = tmp_path / "other.json"
    tokenizer = HFTokenizer.from_file(str(ROOT / "data" / "tokenizer.json"))
    tokenizer.add_tokens(["<|another|>"])
    tokenizer.save(str(other))

    def recipe(path, *more):
        return load_config(DEBUG_RECIPE, ["--checkpoint.init_from_hf", str(folder), "--tokenizer.path", path, *more])

    with pytest.raises(ConfigError, match=r"^tokenizer.path .*other.json is not checkpoint.init_from_hf's own"):
        with_weights_tokenizer(recipe(str(other)))
    allowed = with_weights_tokenizer(recipe(str(other), "--checkpoint.allow_other_tokenizer", "true"))
    assert allowed.tokenizer.path == str(other)
    assert with_weights_tokenizer(recipe(str(folder))).tokenizer.path == str(folder)
    theirs = with_weights_tokenizer(recipe(""))
    assert theirs.tokenizer.path.endswith("tokenizer.json") and theirs.tokenizer.bos_token == ""
