"""What several test files need: documents in memory, full weights of a sharded model, the one-line-error check."""

from __future__ import annotations

import numpy as np
import torch
from torch.distributed.tensor import DTensor


class InMemoryDocuments:
    """The reader interface of PreparedDocuments (lengths, tokens) over token lists held in memory."""

    def __init__(self, documents: list[list[int]]):
        self.documents = [np.asarray(d, dtype=np.int64) for d in documents]
        self.lengths = np.array([len(d) for d in documents], dtype=np.int64)
        self.n_documents = len(documents)

    def tokens(self, doc: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        return self.documents[doc][start:stop].copy()


def numbered_documents(n: int, seed: int = 0, min_len: int = 3, max_len: int = 40) -> InMemoryDocuments:
    """n documents of random lengths whose tokens name the document and the position: doc * 1000 + position."""
    lengths = np.random.default_rng(seed).integers(min_len, max_len, size=n)
    return InMemoryDocuments([[doc * 1000 + i for i in range(length)] for doc, length in enumerate(lengths)])


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_weights(trainer) -> dict[str, torch.Tensor]:
    """Every parameter of this rank's model parts as a whole tensor."""
    return {n: full(p).detach().clone() for n, p in trainer.model_parts.named_parameters()}


def assert_one_line_error(result, *words: str) -> None:
    """A user error from the CLI: exit 2, no traceback, exactly one `error:` line holding every word."""
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr
    assert all(w in errors[0] for w in words), (words, errors[0])


def train_steps(trainer, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train `steps` steps on the trainer's own global batches; returns the losses and the full weights."""
    losses = [trainer.train_step(next(trainer.loader))[0].item() for _ in range(steps)]
    return losses, full_weights(trainer)


def rows_of(batch, rows: slice):
    """Some rows of a batch, still counting the loss tokens of its whole step."""
    from titan.data import IGNORE, Batch

    pick = lambda t: None if t is None else t[rows]  # noqa: E731
    labels = batch.labels[rows]
    return Batch(batch.inputs[rows], labels, batch.rows[rows], pick(batch.document_ids),
                 int((labels != IGNORE).sum()), batch.step_loss_tokens)


def micro_batches_of_rank(trainer, global_batch) -> list:
    """The trainer's data-parallel rank's micro-batches of a global batch given whole."""
    dp_rank = trainer.mesh["dp"].get_local_rank() if trainer.mesh else 0
    share, local = len(global_batch.rows) // trainer.layout.dp, trainer.micro_batch_size
    return [rows_of(global_batch, slice(s, s + local)) for s in range(dp_rank * share, (dp_rank + 1) * share, local)]
