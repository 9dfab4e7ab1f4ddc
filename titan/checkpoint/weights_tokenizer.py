"""The tokenizer of the weights a run starts from, for a recipe that names none. Torch-free until a recipe asks for
it (the checkpoint readers import torch): `titan config show` answers the others before torch loads."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from titan.config import NO_TOKENIZER, Config
from titan.errors import ConfigError
from titan.hub import model_folder


def with_weights_tokenizer(config: Config) -> Config:
    """A recipe that names no tokenizer takes the one of the weights it starts from: the [tokenizer] saved in the
    checkpoint that checkpoint.resume names (a path), else checkpoint.init_from_hf's HF folder's (with the BOS and
    EOS its tokenizer config says). Any other recipe as it is."""
    c = config.checkpoint
    resumes = c.resume not in ("auto", "never")
    if config.tokenizer.path and c.init_from_hf and not c.allow_other_tokenizer:
        _check_own_tokenizer(config)
    if config.tokenizer.path or not (resumes or c.init_from_hf):
        return config
    from titan.checkpoint.hf.exports import saved_tokenizer
    from titan.checkpoint.hf.files import hf_tokenizer
    from titan.checkpoint.resume import find_checkpoint

    if resumes:
        path = find_checkpoint(Path(c.resume), "checkpoint.resume")
        tokenizer, where = saved_tokenizer(path), f"checkpoint.resume's {path}"
    else:
        tokenizer = hf_tokenizer(model_folder(c.init_from_hf, "checkpoint.init_from_hf"))
        where = f"checkpoint.init_from_hf's {c.init_from_hf}"
    if tokenizer is None or not tokenizer.path:
        raise ConfigError(f"{NO_TOKENIZER}: {where} has none")
    return replace(config, tokenizer=tokenizer)


def _check_own_tokenizer(config: Config) -> None:
    """ConfigError when tokenizer.path's vocabulary is not that of checkpoint.init_from_hf's own tokenizer.json: the
    weights learned what its ids mean, and another vocabulary's ids mean other text (loss 9.77 at step 1 where the
    own gave 2.11). The same vocabulary written otherwise (an export's, with its BOS post-processor) is the same."""
    from tokenizers import Tokenizer as HFTokenizer

    from titan.checkpoint.hf.files import own_file
    from titan.data.tokenizer import tokenizer_file

    source = config.checkpoint.init_from_hf
    theirs = own_file(model_folder(source, "checkpoint.init_from_hf"), "tokenizer.json")
    given = tokenizer_file(config.tokenizer.path)
    if theirs is None:
        return
    try:
        ours, their_vocabulary = (
            HFTokenizer.from_file(str(p)).get_vocab(with_added_tokens=True) for p in (given, theirs)
        )
    except Exception:  # a file that does not parse: its reader says so, in its own words, when it reads it
        return
    if ours != their_vocabulary:
        raise ConfigError(
            f"tokenizer.path {config.tokenizer.path} is not checkpoint.init_from_hf's own tokenizer ({theirs}): the "
            "weights' token ids would mean other text; leave tokenizer.path empty to train with theirs, or set "
            "checkpoint.allow_other_tokenizer = true"
        )
