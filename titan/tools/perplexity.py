"""`titan eval --data`: the perplexity of a checkpoint's model on a source, scored as training scores validation.

The source is prepared with the checkpoint's tokenizer (or found prepared) and read whole, in order, in windows of
seq_len + 1 tokens with the documents masked as the run masked them; each batch goes through the trainer's own
evaluation (TrainStep.evaluate), so the loss is the one a run with this source as validation.source logs.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace

import torch
from tqdm import tqdm

from titan.checkpoint.hf import checkpoint_tokenizer
from titan.checkpoint.train_state import read_train_state
from titan.config import Config, DataSource, saved_section
from titan.data import whole_source
from titan.data.loader import Blend, GlobalBatchLoader
from titan.errors import ConfigError
from titan.observe.profiling import StepClock
from titan.parallel.parallelize import ModelParts
from titan.tools.generate import Loaded
from titan.train.step import StepHook, StepLoss, StepRules, Trained, TrainStep


@dataclass(frozen=True)
class Limits:
    """How much of the source is scored, in batches of `batch_size` sequences of `seq_len` tokens (0: the
    checkpoint's recipe's training.seq_len and local_batch_size; batches and tokens 0: all of it)."""

    seq_len: int = 0
    batch_size: int = 0
    batches: int = 0
    tokens: int = 0

    def check(self) -> None:
        for name in ("seq_len", "batch_size", "batches", "tokens"):
            if getattr(self, name) < 0:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(
                    f"{flag} must be >= 0 (0: {'all' if name in ('batches', 'tokens') else 'the recipe'})"
                )


@dataclass(frozen=True)
class Perplexity:
    source: str
    loss: float  # mean token cross-entropy, in nats
    tokens: int  # the tokens whose prediction was scored
    sequences: int
    seq_len: int

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 50.0))  # as the trainer logs it: no overflow for a diverged model

    def line(self) -> str:
        return (
            f"{self.source}: perplexity {self.perplexity:.4f} (loss {self.loss:.4f}) over {self.tokens:,} tokens "
            f"in {self.sequences:,} sequences of {self.seq_len}"
        )


def eval_config(loaded: Loaded, seq_len: int) -> Config:
    """The checkpoint's recipe as far as scoring reads it: its tokenizer (the one the checkpoint names, checked
    against the model), its data section (document masking, the prepared tokens' cache), training.seq_len."""
    path, args = loaded.checkpoint.path, loaded.model.args
    tokenizer = checkpoint_tokenizer(path, args.vocab_size)
    recipe = read_train_state(path)["recipe"]
    try:
        data, training, tokenizer_cfg = (saved_section(recipe, name) for name in ("data", "training", "tokenizer"))
    except ValueError as e:
        raise ConfigError(f"checkpoint {path} is corrupt: the recipe in train_state.json: {e}") from None
    seq_len = seq_len or training.seq_len
    if seq_len > args.max_seq_len:
        raise ConfigError(f"--seq-len {seq_len} is longer than the model's max_seq_len {args.max_seq_len}")
    return Config(
        tokenizer=replace(tokenizer_cfg, path=str(tokenizer.path)),
        data=data,
        training=replace(training, seq_len=seq_len),
    )


def evaluation_step(loaded: Loaded, autocast: bool) -> TrainStep:
    """The trainer's step around the loaded model, for its evaluation only: no optimizer, one process."""
    device = next(loaded.model.parameters()).device
    parts = ModelParts([loaded.model], [0], 1)
    rules = StepRules.one_process(autocast)
    return TrainStep(
        Trained(parts, None, None), rules, StepLoss(StepHook()), device=device, clock=StepClock(False, device)
    )


def perplexity(loaded: Loaded, source: DataSource, limits: Limits = Limits()) -> Perplexity:
    """The perplexity of the loaded checkpoint's model on `source`, read from its start."""
    limits.check()
    config = eval_config(loaded, limits.seq_len)
    samples = whole_source(config, source, f"--data {source.source}")
    seq_len = config.training.seq_len
    batch = min(limits.batch_size or config.training.local_batch_size, samples.samples_per_epoch)
    batches = samples.samples_per_epoch // batch  # whole batches: the last few sequences of the source are left
    for limit in (limits.batches, math.ceil(limits.tokens / (batch * seq_len))):
        batches = min(batches, limit or batches)
    loader = GlobalBatchLoader([samples], Blend([1.0]), batch, range(batch), [batch], config.data.document_mask)
    step = evaluation_step(loaded, autocast=config.training.mixed_precision == "bf16")
    loss_sum, tokens = torch.zeros((), dtype=torch.float64), 0
    for i in tqdm(range(batches), desc=f"scoring {source.source}", file=sys.stderr, disable=not sys.stderr.isatty()):
        micro_batches = loader.batches_at(i * batch)
        scored = micro_batches[0].step_loss_tokens
        loss_sum += step.evaluate([micro_batches]).double().cpu() * scored  # the batch's mean, weighed by its tokens
        tokens += scored
    return Perplexity(source.source, float(loss_sum) / tokens, tokens, batches * batch, seq_len)
