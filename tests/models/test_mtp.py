"""DeepSeek-V3's multi-token prediction in the moe family against a reference written here from its definition
(plain PyTorch: the embedding rows, the two norms, the projection, the block called directly, the final norm and
the shared head, targets shifted within each document), and what it leaves alone: the main model's outputs, its
parameters, decoding with the cache."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from distributed import run_distributed
from helpers import cp_sequence
from titan import models, rng
from titan.models.moe import MoETransformer
from titan.models.moe.parallelize import pipeline_stage
from titan.parallel.cp.ring import ContextParallel
from titan.tools.generate import generate

IGNORE = -100  # the data's label of a token that carries no loss
SEQ = 24
# Each row's documents (lengths of seq + 1 tokens: inputs and, shifted by one, labels), and a label the data ignores
# inside a document (row, window position).
DOCUMENTS = [[7, 12, 6], [25]]
IGNORED = (1, 6)


def relative_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference over the largest value: fp32 ops in another order (attention one document at a time
    in the model, with a mask here) differ by a few units of the last place."""
    return float((got - want).detach().abs().max() / want.detach().abs().max())


def build(seed: int = 0, **overrides) -> MoETransformer:
    args = models.model_args("moe", "debug", {"max_seq_len": 64, **overrides})
    with torch.device("meta"):
        model = MoETransformer(args)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model


def batch():
    """Windows of SEQ + 1 tokens with their documents, and the inputs, labels and document ids the loader makes of
    them (IGNORE where the next token is another document's, and at IGNORED)."""
    generator = torch.Generator().manual_seed(3)
    window = torch.randint(0, 2048, (len(DOCUMENTS), SEQ + 1), generator=generator)
    window_docs = torch.tensor([sum(([d] * n for d, n in enumerate(lengths)), []) for lengths in DOCUMENTS])
    labels = window[:, 1:].masked_fill(window_docs[:, 1:] != window_docs[:, :-1], IGNORE)
    labels[IGNORED[0], IGNORED[1] - 1] = IGNORE
    return window, window_docs, window[:, :-1], labels, window_docs[:, :-1]


def reference(model: MoETransformer, window, window_docs):
    """(main logits, each depth's logits at the positions i < SEQ - k whose inputs are in the row, each depth's
    summed token loss) from the definition: h^k_i = block_k(eh_proj_k(cat[enorm_k(E[t_{i+k}]), hnorm_k(h^{k-1}_i)]))
    with h^0 the main stack's final normed state, logits^k = W_out norm_k(h^k), target t_{i+k+1} where it is in the
    row and in i's document and not ignored."""
    eps, rows = model.args.norm_eps, torch.arange(len(window))
    docs = window_docs[:, :-1]
    positions = torch.tensor([[sum(docs[r, j] == docs[r, i] for j in range(i)) for i in range(SEQ)] for r in rows])
    rope = model.rope[positions]
    same = (docs[:, :, None] == docs[:, None, :]) & torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    norm = lambda x, module: F.rms_norm(x, (x.shape[-1],), module.weight, eps)  # noqa: E731
    h = model.tok_embeddings.weight[window[:, :-1]]
    for layer in model.layers.values():
        h = layer(h, rope, rows, same.unsqueeze(1))
    h = norm(h, model.norm)
    main, depths, losses = F.linear(h, model.output.weight), [], []
    for k, module in enumerate(model.mtp.values(), start=1):
        n = SEQ - k  # the positions whose token k ahead is in the row
        embedded = model.tok_embeddings.weight[window[:, k : k + n]]
        x = F.linear(torch.cat([norm(embedded, module.enorm), norm(h[:, :n], module.hnorm)], -1), module.eh_proj.weight)
        h = module.block(x, rope[:, :n], rows, same[:, :n, :n].unsqueeze(1))
        logits = F.linear(norm(h, module.norm), model.output.weight)
        depths.append(logits)
        loss = torch.zeros(())
        for r in rows:
            for i in range(n):
                j = i + k + 1  # the target's place in the window
                if j <= SEQ and window_docs[r, j] == window_docs[r, i] and (r, j) != IGNORED:
                    loss = loss + F.cross_entropy(logits[r, i], window[r, j])
        losses.append(loss)
    return main, depths, losses


def forward_with_labels(model: MoETransformer, scale: float):
    """The model's logits with the labels, its prediction modules' logits (the shared head's later calls, by a
    hook), and the trainer's loss of the logits (summed token loss times the scale)."""
    _, _, inputs, labels, document_ids = batch()
    heads = []
    hook = model.output.register_forward_hook(lambda module, args, out: heads.append(out))
    model.routing.set_loss_scale(scale)
    logits = model(inputs, document_ids=document_ids, labels=labels)
    hook.remove()
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=IGNORE) * scale
    return logits, heads[:-1], loss


@pytest.mark.parametrize("depths", [1, 2])
def test_the_prediction_modules_logits_and_loss_are_their_definitions(depths):
    """Every norm weight of the modules differs (a swapped enorm and hnorm would show); the loss on the step loss's
    scale, the mean over depths, reaches step_losses."""
    model = build(mtp_layers=depths)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for module in model.mtp.values():
            for norm in (module.enorm, module.hnorm, module.norm):
                norm.weight.uniform_(0.5, 1.5, generator=generator)
    window, window_docs, *_ = batch()
    scale = 1 / 40
    logits, heads, _ = forward_with_labels(model, scale)
    main, expected, losses = reference(model, window, window_docs)
    assert len(heads) == depths and relative_difference(logits, main) < 1e-6
    for k, (got, want) in enumerate(zip(heads, expected), start=1):
        assert want.abs().max() > 1 and relative_difference(got[:, : SEQ - k], want) < 1e-6, k
    want_loss = torch.stack(losses).mean() * scale
    assert 1 < want_loss and relative_difference(model.step_losses()["mtp_loss"], want_loss) < 1e-6
    assert model.step_losses()["mtp_loss"] == 0  # counted once, then from zero


def test_the_gradient_is_the_objectives_and_reaches_the_modules_the_embedding_and_the_stack():
    """The trainer's backward of its token loss, the logits taken with the labels, gives the gradient of the token
    loss plus mtp_loss_weight times the reference's prediction loss; that part of it reaches the prediction module,
    the embedding, the main stack and the head. Without the balance loss: the blocks route every position of the
    row, also those whose token k ahead is past it (they carry no loss), where the reference has none."""
    weight, scale = 0.7, 1 / 40
    model = build(mtp_layers=2, mtp_loss_weight=weight, aux_loss_coef=0.0)
    window, window_docs, inputs, labels, document_ids = batch()
    _, _, loss = forward_with_labels(model, scale)
    loss.backward()
    got = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    main, _, losses = reference(model, window, window_docs)
    token_loss = F.cross_entropy(main.flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=IGNORE) * scale
    (token_loss + weight * torch.stack(losses).mean() * scale).backward()
    for name, p in model.named_parameters():
        assert relative_difference(got[name], p.grad) < 1e-6, name
    model.zero_grad()
    logits = model(inputs, document_ids=document_ids)  # without labels: the token loss alone
    (F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=IGNORE) * scale).backward()
    moved = {name for name, p in model.named_parameters() if p.grad is None or not torch.equal(got[name], p.grad)}
    reached = ("mtp.4.eh_proj.weight", "mtp.5.block.attention.wq.weight", "mtp.5.block.feed_forward.experts.w1")
    assert {*reached, "tok_embeddings.weight", "layers.0.attention.wq.weight", "layers.3.feed_forward.experts.w2",
            "norm.weight", "output.weight"} <= moved  # fmt: skip


def test_the_main_model_is_what_it_was_without_the_modules():
    """With mtp_layers = 0 the model has no prediction parameters, reads no labels and adds no loss; with modules,
    the main model's parameters and logits are the same bits (parameters are initialised by name)."""
    plain, predicting = build(), build(mtp_layers=1)
    _, _, inputs, labels, document_ids = batch()
    alone = plain(inputs, document_ids=document_ids)
    assert torch.equal(plain(inputs, document_ids=document_ids, labels=labels), alone)
    assert plain.step_losses() == {} and not [name for name, _ in plain.named_parameters() if "mtp" in name]
    params = dict(predicting.named_parameters())
    assert all(torch.equal(p, params[name]) for name, p in plain.named_parameters())
    assert torch.equal(predicting(inputs, document_ids=document_ids, labels=labels), alone)


def test_decoding_with_the_cache_gives_the_full_forwards_tokens_and_skips_the_modules():
    model = build(mtp_layers=1).eval()
    forwards, heads = [], []
    model.register_forward_hook(lambda module, args, out: forwards.append(out))
    model.output.register_forward_hook(lambda module, args, out: heads.append(out))
    prompt = batch()[2][0, :6].tolist()
    cached = generate(model, [prompt], 8).tokens[0]
    assert len(heads) == len(forwards) > 1  # the head once per forward: no module's
    with torch.no_grad():
        sequence = list(prompt)
        for _ in range(8):
            sequence.append(int(model(torch.tensor([sequence]))[0, -1].argmax()))
    assert cached == sequence[len(prompt) :]


def gradients(model) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def test_pipeline_stages_pass_the_lookahead_embeddings_on_and_train_as_the_whole_model():
    """The first stage holds the embedding and the last the modules: the first sends its hidden states with the
    embeddings of the tokens each depth looks ahead to (args.stage_width, as the schedule's tensors are declared),
    and the two stages' logits, prediction loss and every gradient, the embedding's through the sent tensor, are
    the whole model's. The first stage's rank logs no prediction loss of its own."""
    model = build(mtp_layers=2)
    _, _, inputs, labels, document_ids = batch()
    rows = torch.arange(len(inputs))
    first, last = (copy.deepcopy(pipeline_stage(model, ids, ids == [0, 1], ids == [2, 3])) for ids in ([0, 1], [2, 3]))
    assert first.mtp is not None and not first.mtp and list(last.mtp) == ["4", "5"] and last.tok_embeddings is None
    for part in (model, first, last):
        part.routing.set_loss_scale(1 / 40)
    whole = model(inputs, rows, document_ids, labels=labels)
    whole.square().sum().backward()
    sent, *passed = first(inputs, rows, document_ids, labels=labels)
    assert sent.shape == (*inputs.shape, model.args.stage_width) == (*inputs.shape, 3 * model.args.dim)
    received = sent.detach().requires_grad_()
    logits = last(received, *passed, labels=labels)
    logits.square().sum().backward()
    sent.backward(received.grad)
    assert torch.equal(logits, whole)
    assert torch.equal(last.step_losses()["mtp_loss"], model.step_losses()["mtp_loss"])
    assert first.step_losses() == {"mtp_loss": 0}
    staged = gradients(first) | gradients(last)
    assert staged.keys() == gradients(model).keys()
    for name, grad in gradients(model).items():
        assert relative_difference(staged[name], grad) < 1e-6, name


def context_parallel_share(cp: int, seed: int):
    """On this rank of a cp group: the model's logits at its positions (ring attention, the whole rows' document
    ids), the prediction loss it logs and its gradients, for the objective the trainer backpropagates."""
    init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    rank = dist.get_rank()
    model = build(seed, mtp_layers=2, aux_loss_coef=0.0)
    _, _, inputs, labels, document_ids = batch()
    ring = ContextParallel(dist.group.WORLD, rank, cp, cp_sequence(cp, SEQ, rank), SEQ, "cpu")
    for module in model.modules():
        if hasattr(module, "context_parallel"):
            module.context_parallel = ring
        if isinstance(module, rng.Dropout):
            module.sequence = (SEQ, ring.positions)
    model.routing.set_loss_scale(1 / 40)
    here = ring.positions
    logits = model(inputs[:, here], None, document_ids, labels=labels[:, here])
    logits.square().sum().backward()
    return here, logits.detach(), model.step_losses()["mtp_loss"], gradients(model)


@pytest.mark.distributed
def test_under_context_parallelism_each_rank_predicts_its_positions_from_the_whole_rows():
    """Depth k's input token and target at a position may be another rank's (the shift crosses the sequence's
    chunks): two ranks of a cp group give one process's logits at their positions, and their prediction losses and
    gradients sum to its."""
    shares = run_distributed(context_parallel_share, 2, 2, 0)
    model = build(0, mtp_layers=2, aux_loss_coef=0.0)
    _, _, inputs, labels, document_ids = batch()
    model.routing.set_loss_scale(1 / 40)
    whole = model(inputs, None, document_ids, labels=labels)
    whole.square().sum().backward()
    assert sorted(torch.cat([here for here, *_ in shares]).tolist()) == list(range(SEQ))
    for here, logits, *_ in shares:
        assert relative_difference(logits, whole[:, here]) < 1e-6
    want = model.step_losses()["mtp_loss"]
    assert want > 1 and relative_difference(sum(loss for _, _, loss, _ in shares), want) < 1e-6
    # Measured within 1.4e-6: the ring merges its blocks' softmax in another order than one softmax over the row.
    for name, grad in gradients(model).items():
        assert relative_difference(sum(share[3][name] for share in shares), grad) < 1e-5, name
