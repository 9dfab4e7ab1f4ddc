"""What titan may use of a model family: the trainer, titan/parallel, the checkpoints, `titan plan`, `titan generate`
and the simulators reach a model only through these. A family provides a ModelSpec; its args and the modules its
`build` returns offer what `Args` and `Model` declare, and nothing else of them is read from outside the family.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

if TYPE_CHECKING:  # annotations only: a recipe's model is checked before torch is imported
    import torch
    from torch import nn


class PerRow(NamedTuple):
    """Something training computes per row, which token batching refuses: what it is, why, and how to turn it off."""

    what: str
    why: str
    fix: str


class Args(Protocol):
    """A family's model args: a dataclass (flavors, recipe overrides and checkpoints hold them), of whose fields
    titan reads and replaces only these."""

    # Blocks: pipeline stages split them, and `dataclasses.replace(args, n_layers=k)` describes a model of k blocks
    # (the cost model times a stage's share; titan plan asks ModelSpec.layers_args, which keeps each block's kind).
    n_layers: int
    vocab_size: int  # tokens the embedding holds: the tokenizer must fit in it
    max_seq_len: int  # positions the model takes: the trainer checks sequences against it and sizes it to them

    @property
    def per_row(self) -> PerRow | None:
        """What training computes per row of the batch (None: nothing). Token batching cannot have it yet: its rows
        are packings of documents that differ by layout."""
        ...

    def validate(self) -> None:
        """ValueError naming what makes these args impossible."""
        ...

    def check_parallelism(self, tp: int, pp_stages: int, ep: int = 1, cp: int = 1) -> None:
        """ValueError when these degrees (tensor, pipeline stages, expert, context) cannot split the model."""
        ...

    def block_params(self, layer: int) -> int:
        """Parameters of block `layer` as the built model holds them, counted without building it: the layer split
        sizes the blocks before torch is imported."""
        ...


class Routing(Protocol):
    """A mixture of experts' routing, which the step drives (titan/models/moe/routing.py has the family's)."""

    def set_loss_scale(self, scale: float) -> None:
        """Before each micro-batch: the auxiliary balance loss (and a multi-token prediction's) is on the step loss's
        scale."""
        ...

    def split_rows(self, cp_group: Any, tp_group: Any) -> None:
        """The process groups that split each row's tokens (None: not split there), which balancing sums over."""
        ...

    def end_step(self, groups: tuple, finite: torch.Tensor, stages: tuple[Routing, ...] = ()) -> dict:
        """After the optimizer: sum the step's expert loads over `groups` (the ranks that split its tokens, and the
        pipeline's; `stages`: this rank's other stages' routing, in the same collectives), move the balancing
        biases unless the step was skipped (`finite` false), and return the step's routing metrics for the whole
        model."""
        ...


class Model(Protocol):
    """What ModelSpec.build returns, and pipeline_stage cuts: an nn.Module (parameters, to_empty, train, ... as torch
    has them) with these besides."""

    args: Args  # what it was built from (titan generate reads max_seq_len and vocab_size)
    # Context parallelism's slot (titan/parallel/cp/ring.py puts its ring in it, on the model and on every module of it
    # with the slot): the model reads `positions` (this rank's positions of each row) and `mask(document_ids)`, and
    # its attention modules call `attend(q, k, v, mask, rows, dropout, scale, logit_max)` when `is_ring(mask)`. None:
    # the model holds whole sequences, as it does under it for a micro-batch called with local=True.
    context_parallel: Any
    # QK-clip's slot is on the attention modules: see ClippedAttention.
    # Sequence parallelism's slot (titan/parallel/parallelize.py sets it: tp under sequence parallelism, else 1): a
    # pipeline stage other than the first takes hidden states cut into this many shards of the sequence, and counts a
    # decoding forward's positions on the whole sequence.
    sequence_shards: int
    # Expert parallelism's slot is on the modules that hold experts, those with an `expert_parallel` attribute: each
    # stacks its experts' parameters along dim 0, which titan/parallel/ep.py shards over the ep group, and when the
    # slot is set calls `expert_parallel(compute, x, counts, *weights)` in place of `compute(x, counts, *weights)`
    # (x its tokens sorted by expert, counts[e] of them for expert e), which computes each token on its experts' rank.
    # A module the family's TP plan marks with a true `tp_gradient_shares` attribute computes on its tp rank's own
    # tokens (or heads) with its parameters whole on every tp rank: the step sums their gradients over tp
    # (titan/parallel/tp.py).
    routing: Routing | None  # a mixture of experts' routing, which the step drives (None: a dense model)

    def __call__(
        self,
        tokens: torch.Tensor,
        rows: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        cache: Any = None,
        local: bool = False,
        labels: torch.Tensor | None = None,
    ) -> Any:
        """tokens (batch, seq) -> logits (batch, seq, vocab). rows: each sample's row in the step's global batch,
        which dropout masks are keyed by (default 0..batch-1). document_ids (batch, seq): packed documents, each
        attending only to itself. A pipeline stage other than the first takes hidden states for `tokens`; one other
        than the last returns what the next stage takes (see StageIO). cache: from kv_cache, when decoding. local:
        under context parallelism, whole rows of this rank's own rather than its positions of its cp group's rows.
        labels (batch, seq): a training forward's next tokens (the data's IGNORE where none), which a model whose
        objective looks further ahead reads (a multi-token prediction): it adds its own loss, on the step loss's
        scale, inside the backward of the logits, which stay the same (see step_losses)."""
        ...

    def step_losses(self) -> dict[str, torch.Tensor]:
        """The losses the model added to the objective since the last call (forwards with labels), by name, each
        unweighted, as this rank's share on the step loss's scale: summed over the ranks the step's loss sums over,
        it is the step's. Counting starts again from zero. {}: the next-token loss is the whole objective."""
        ...

    def init_weights(self, seed: int) -> None:
        """Initialise every parameter and buffer from the seed alone, on any layout (after `to_empty`)."""
        ...

    def init_buffers(self, positions: int | None = None) -> None:
        """Compute the buffers from the args alone, leaving the parameters alone (after `to_empty`): loading the
        parameters from a checkpoint then completes the model without initialising them first. positions: the
        most a command runs (`titan generate`'s prompts and tokens), which position tables need cover; default the
        model's max_seq_len."""
        ...

    def kv_cache(self, batch: int, max_len: int, pad: torch.Tensor | None = None) -> Any:
        """A cache for decoding up to max_len tokens of `batch` sequences: forward with it takes the tokens after
        the cached ones and adds them to it. pad (batch,): row b's first pad[b] tokens are left padding, which
        nothing attends to and which no position counts (None: no padding)."""
        ...


@dataclass(frozen=True, kw_only=True)
class StageBatch:
    """What one pipeline stage's tensors for a micro-batch depend on: ModelSpec.pipeline_io's question."""

    rows: int  # sequences in the micro-batch
    seq_len: int  # tokens of each
    dtype: torch.dtype  # of the hidden states stages pass (bf16 under FSDP's mixed precision)
    seq_shards: int = 1  # sequence parallel: the passed hidden states hold 1/seq_shards of the sequence
    # Context parallel: token ids, hidden states and logits hold 1/context_shards of the sequence (a rank's chunks);
    # document ids stay whole.
    context_shards: int = 1
    documents: bool = False  # document ids travel with the rows (document masking)
    first: bool  # the stage takes token ids
    last: bool  # the stage returns logits


@dataclass(frozen=True)
class StageIO:
    """One pipeline stage's inputs and outputs for a micro-batch, as meta tensors in the order forward takes and
    returns them: the pipeline schedule allocates its buffers from them without running a forward to find them.
    The last stage's logits go to the loss, not to another stage, so only their presence counts."""

    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]


@dataclass(frozen=True, kw_only=True)
class HFAdapter:
    """Conversion between the family's args and weights and a Hugging Face checkpoint (config.json + safetensors).

    Pure functions; titan/checkpoint/hf/ reads and writes the files. Weights are mapped tensor by tensor, so a reader
    can fetch only the part of an HF tensor that one shard needs: titan row r of a parameter is row rows[r] of
    its HF tensor (rows None: the same rows). A parameter may also be a stack of HF tensors along a new dim 0 (a
    MoE's experts, one HF tensor each): its source then names them all, in order, and rows index each one's rows.
    """

    args_from_config: Callable[[dict], Args]  # config.json dict -> model args; ValueError names an unsupported field
    # (args, dtype="float32") -> config.json dict; ValueError when the HF model cannot express these args
    config_from_args: Callable[..., dict]
    # args -> {titan parameter name: (HF tensor name, or a tuple of the names it stacks; rows or None)}
    sources: Callable[[Args], dict]
    check_names: Callable[[Any, Args], dict]  # (HF tensor names, args) -> {tied copy: HF tensor it must equal}
    to_hf_tensor: Callable[[Any, Any], Any]  # (titan tensor, its rows) -> the tensor as HF stores it
    # Args fields that are training choices rather than properties of the weights: an HF model and the recipe
    # that uses it may differ in them.
    training_choices: tuple[str, ...]
    # config.json's model_types this family reads: `titan convert hf-to-dcp` picks the family by it
    model_types: tuple[str, ...]
    # (args, {buffer name: tensor}) -> None: the state a model holds besides its parameters (a MoE's routing
    # biases) that `sources` does not name, which the HF checkpoint has no place for; ValueError when its values
    # make a model the HF one is not. An HF checkpoint imports with these buffers at zero. None: the family's
    # models have no such buffers. A buffer `sources` names is read and written as the parameters are.
    check_buffers: Callable[[Args, dict], None] | None = None
    # (args, the files' tensor names) -> (the args of the model the files hold, a note where they differ from
    # config.json's); None: always config.json's.
    held_args: Callable[[Args, Any], tuple] | None = None
    # args -> {HF tensor: the HF tensor it copies} that an export writes besides the sources' (a DeepSeek-V3 MTP
    # layer's own embedding); None: none.
    export_copies: Callable[[Args], dict] | None = None


class ClippedAttention(Protocol):
    """An attention module QK-clip reads and scales (titan/optim/qk_clip.py): a module of the model with a
    `qk_clip_scales` method."""

    n_heads: int  # its query heads, all of them (a tensor-parallel rank holds its share)
    # None, or (set by QK-clip, when training) what takes each of its heads' largest pre-softmax logit of a forward:
    # `logit_max.add(per_head)`; the context-parallel ring records the blocks it computes there.
    logit_max: Any

    def qk_clip_scales(self, gamma: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """{parameter name: (rows,) scale of each of its rows} that clips each head h by gamma[h] (n_heads,); None:
        it cannot be clipped."""
        ...


@dataclass(frozen=True)
class RoutedExperts:
    """A mixture of experts' routing, as `titan plan` counts expert parallelism's all-to-all by its formula."""

    width: int  # elements of one token's hidden state, which the all-to-all sends to each of its experts
    top_k: int  # experts per token
    n_experts: int
    expert_layers: tuple[int, ...]  # the layers with routed experts


def alike_layers(args: Args, layer_ids: Sequence[int]) -> Args:
    """ModelSpec.layers_args of a family whose blocks are all alike: a model of as many blocks."""
    return dataclasses.replace(args, n_layers=len(layer_ids))


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A model family, as titan uses it; each member says who does."""

    name: str
    flavors: dict[str, Args]  # flavor name -> args; recipes pick one and override fields
    # (args, traceable=False) -> model, called under torch.device("meta"). traceable: its forward takes no Python
    # branch on input values, as compiled blocks and titan plan's fake tensors need (document masks as tensors).
    build: Callable[..., Model]
    flops_per_token: Callable[[Args, int], float]  # (args, seq_len) -> training FLOPs per token: MFU, titan plan
    # (args) -> the width of one token's keys (as of its values) in one layer: context parallelism's ring traffic
    kv_width: Callable[[Args], int]
    # Parallelism, applied from outside by titan/parallel (Args.check_parallelism says which degrees can split it):
    tp_plan: Callable[..., dict]  # (model, sequence_parallel, loss_parallel, styles=None) -> {fqn: style}
    # Units for checkpointing, compile, FSDP and titan plan's block graph: the layers' blocks in order, then any the
    # model holds after its layers (a multi-token prediction's, on the last stage), whose kind is the last layer's.
    blocks: Callable[[Model], list[nn.Module]]
    pipeline_stage: Callable[[Model, list[int], bool, bool], Model]  # (model, layer ids, first, last) -> stage
    pipeline_io: Callable[[Args, StageBatch], StageIO]  # a stage's tensors for the pipeline schedule and titan plan
    # (args, rows, seq_len, dtype) -> a block's positional inputs for rows x seq_len tokens, made on the current
    # device (or fake tensor mode), the hidden states first, in dtype and requiring grad: titan plan traces a block.
    block_inputs: Callable[[Args, int, int, torch.dtype], tuple[torch.Tensor, ...]]
    hf: HFAdapter | None = None  # Hugging Face import and export, if the family has them
    routed_experts: Callable[[Args], RoutedExperts] | None = None  # a mixture of experts'; None: a dense family
    # (args, layer ids) -> the args of a model of len(layer ids) blocks, each built as that layer of args' model is
    # (a mixture of experts' dense or routed layer): titan plan traces a pipeline stage's blocks and one block of
    # each kind from them. ValueError when the family cannot build the layers in that order.
    layers_args: Callable[[Args, Sequence[int]], Args] = alike_layers

    def block_kinds(self, args: Args) -> list[str]:
        """Each layer's kind of block, whose figures titan plan and auto checkpointing take for it: "routed" for
        a mixture of experts' layers with routed experts (routed_experts' expert_layers), "dense" for the others."""
        routed = set(self.routed_experts(args).expert_layers) if self.routed_experts else set()
        return ["routed" if layer in routed else "dense" for layer in range(args.n_layers)]
