"""The training loop end to end: it learns, it repeats bitwise, and accumulation equals a big batch."""

import json
import math

import pytest
import torch

from conftest import DEBUG_RECIPE, run_titan, tiny_overrides
from titan.config import LRScheduler, load_config
from titan.observe.metrics import RemainingTime, due_after, format_line, peak_flops
from titan.optim import clip_grad_norm_, lr_factor
from titan.train.trainer import Trainer


def read_metrics(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "loss" in r]  # step records; checkpoint timings are records of their own


@pytest.mark.slow
@pytest.mark.smoke
def test_debug_recipe_trains_from_the_cli_and_the_loss_falls(tmp_path):
    result = run_titan(
        "train",
        "--config",
        str(DEBUG_RECIPE),
        *tiny_overrides(tmp_path, **{"training.steps": "30", "metrics.tensorboard": "true"}),
    )
    assert result.returncode == 0, result.stderr
    run_dir = tmp_path / "debug"
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, 31))
    first, last = metrics[0]["loss"], metrics[-1]["loss"]
    assert first > 0.9 * math.log(2048)  # an untrained model is near uniform over the vocabulary
    assert last < 0.8 * first, (first, last)
    for key in ("grad_norm", "lr", "tokens_per_s", "mfu", "step_time_s", "peak_memory_gib", "tokens_seen"):
        assert metrics[-1][key] > 0, key
    assert metrics[-1]["tokens_seen"] == 30 * 4 * 64
    assert load_config(run_dir / "config.toml").training.steps == 30  # the resolved recipe reloads
    assert json.loads((run_dir / "run_info.json").read_text())["world_size"] == 1
    assert any((run_dir / "tensorboard").iterdir())
    assert "step 30/30" in result.stderr
    assert "MFU: relative to metrics.peak_flops = 1e+11 FLOP/s" in result.stderr  # what the MFU figure means


def test_a_run_ends_with_a_summary_and_its_console_log_is_kept_in_the_run_folder(tmp_path):
    steps = {"training.steps": "3", "validation.interval": "1", "validation.steps": "1", "checkpoint.interval": "2"}
    first = run_titan("train", "--config", str(DEBUG_RECIPE), *tiny_overrides(tmp_path, **steps))
    assert first.returncode == 0, first.stderr
    run_dir = tmp_path / "debug"
    console = (run_dir / "console.log").read_text()
    summary = first.stderr[first.stderr.index("run summary:") :]
    assert "steps 1-3 of 3" in summary and f"{3 * 4 * 64:,} tokens seen" in summary and "tokens/s" in summary
    assert "peak memory" in summary
    loss = read_metrics(run_dir)[-1]["loss"]
    assert f"loss {loss:.4f}" in summary
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    validated = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    best = min(validated, key=validated.get)
    assert f"validation loss {validated[3]:.4f} (best {validated[best]:.4f}, step {best})" in summary
    assert f"in {run_dir}: checkpoints/step-3, metrics.jsonl, console.log" in summary
    step_lines = [line for line in first.stderr.splitlines() if " step 1/3 " in line or " step 3/3 " in line]
    for line in (*step_lines, *summary.splitlines()):  # each in console.log, after its time of day
        assert line.removeprefix(line.split(" ")[0]) in console, line
    more = {**steps, "training.steps": "4", "checkpoint.allow_changes": "training.steps"}
    resumed = run_titan("train", "--config", str(DEBUG_RECIPE), *tiny_overrides(tmp_path, **more))
    assert resumed.returncode == 0, resumed.stderr
    appended = (run_dir / "console.log").read_text()
    assert appended.startswith(console) and "step 4/4" in appended[len(console) :]
    assert "step 4 of 4" in appended[len(console) :]


def test_mfu_peaks_name_their_source_and_gpus_match_exactly(monkeypatch):
    assert peak_flops(torch.device("cpu"), 5e12) == (5e12, "metrics.peak_flops = 5e+12 FLOP/s")
    rate, what = peak_flops(torch.device("cpu"))
    assert rate > 1e8 and "measured fp32 matmul rate" in what and "not a datasheet peak" in what
    for name, want in [("NVIDIA L40", 181e12), ("NVIDIA L4", 121e12), ("NVIDIA H100 80GB HBM3", 989e12)]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, name=name: name)
        assert peak_flops(torch.device("cuda", 0))[0] == want, name
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA L40 Custom")
    assert peak_flops(torch.device("cuda", 0)) == (
        0.0, "unknown GPU 'NVIDIA L40 Custom': no MFU is reported; set metrics.peak_flops to its peak FLOP/s"
    )  # fmt: skip
    line = format_line(3, 10, {"loss": 1.0, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 10.0, "step_time_s": 0.1,
                               "peak_memory_gib": 1.0}, eta_s=1.0)  # fmt: skip
    assert "| mfu - |" in line


def tiny_trainer(tmp_path, **extra):
    overrides = tiny_overrides(tmp_path, **{"model.overrides.n_layers": "2", **extra})
    return Trainer(load_config(DEBUG_RECIPE, overrides))


def test_the_eta_counts_the_evaluations_and_saves_still_to_come():
    # 10 steps; validation at 4, 8 and 10 (the last step); checkpoints at 5 and 10.
    remaining = RemainingTime(total=10, validation_interval=4, validation_steps=6, checkpoint_interval=5)
    assert remaining.eta(3, step_time=1.0) == 7 + 3 * (6 / 3)  # an evaluation not yet timed: 6 batch forwards
    remaining.record("validation", 2.0)
    remaining.record("validation", 4.0)
    remaining.record("checkpoint", 3.0)
    assert remaining.eta(3, step_time=1.0) == 7 + 3 * 3.0 + 2 * 3.0
    assert remaining.eta(8, step_time=0.5) == 1 + 3.0 + 3.0
    assert remaining.eta(10, step_time=0.5) == 0
    assert RemainingTime(10, 0, 6, 0).eta(3, step_time=1.0) == 7  # no validation, no checkpoints
    for total in range(1, 30):  # against the trainer's own test of each step
        for interval in range(1, 12):
            for step in range(total + 1):
                due = sum(s % interval == 0 or s == total for s in range(step + 1, total + 1))
                assert due_after(step, total, interval) == due, (step, total, interval)


def test_the_trainer_times_each_evaluation_and_save_for_its_eta(tmp_path):
    extra = {"training.steps": "4", "validation.interval": "2", "validation.fraction": "0.1", "validation.steps": "1",
             "checkpoint.interval": "3"}  # fmt: skip
    trainer = Trainer(load_config(DEBUG_RECIPE, tiny_overrides(tmp_path, **extra)))
    trainer.train()
    records = [json.loads(line) for line in (tmp_path / "debug" / "metrics.jsonl").read_text().splitlines()]
    assert trainer.report.remaining.seconds == {
        "validation": [r["val_time_s"] for r in records if "val_time_s" in r],  # steps 2 and 4
        "checkpoint": [r["checkpoint_blocked_s"] for r in records if "checkpoint_blocked_s" in r],  # steps 3 and 4
        "eval": [],  # no eval.tasks
    }
    assert [len(v) for v in trainer.report.remaining.seconds.values()] == [2, 2, 0]


def test_same_seed_gives_bitwise_identical_losses(tmp_path):
    runs = [tiny_trainer(tmp_path / str(i), **{"training.steps": "6"}).train() for i in range(2)]
    assert runs[0] == runs[1]
    other_seed = tiny_trainer(tmp_path / "2", **{"training.steps": "6", "job.seed": "1"}).train()
    assert other_seed != runs[0]


def test_gradient_accumulation_equals_one_big_batch(tmp_path):
    big = tiny_trainer(tmp_path / "big", **{"training.local_batch_size": "8"})
    small = tiny_trainer(tmp_path / "small", **{"training.local_batch_size": "2", "training.global_batch_size": "8"})
    assert len(small.rank_plan.micro_batches) == 4
    loss_big = big.stepper.forward_backward(next(big.loader), big.step)
    micro = next(small.loader)
    assert len(micro) == 4
    loss_small = small.stepper.forward_backward(micro, small.step)
    # fp32 sums of the same terms in another order. Measured: loss differs by 1 ulp (9.5e-7 of 8.0), and the
    # worst gradient element by 4e-7 of its tensor's largest element; the bounds leave ~25x headroom.
    torch.testing.assert_close(loss_small, loss_big, rtol=1e-6, atol=0)
    for (name, p_big), (_, p_small) in zip(big.model_parts.named_parameters(), small.model_parts.named_parameters()):
        torch.testing.assert_close(p_small.grad, p_big.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_a_short_run_of_a_long_recipe_warms_up_over_the_whole_run():
    """A smoke run shorter than the recipe's warmup trains (with a warning) instead of being refused."""
    long_warmup = LRScheduler(warmup_steps=50, decay="cosine", min_lr_ratio=0.1)
    assert [lr_factor(s, 4, long_warmup) for s in range(4)] == [0.2, 0.4, 0.6, 0.8]  # as a warmup of 4 would
    shown = run_titan("config", "show", "--config", str(DEBUG_RECIPE), "--training.steps", "5")
    assert shown.returncode == 0 and "warmup_steps (20) is longer than the run (training.steps 5)" in shown.stderr


def test_lr_schedules_by_hand():
    cosine = LRScheduler(warmup_steps=4, decay="cosine", min_lr_ratio=0.1)
    assert [lr_factor(s, 14, cosine) for s in range(4)] == [0.2, 0.4, 0.6, 0.8]
    assert lr_factor(4, 14, cosine) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.1)))
    assert lr_factor(13, 14, cosine) == pytest.approx(0.1)
    linear = LRScheduler(warmup_steps=0, decay="linear", min_lr_ratio=0.0)
    assert lr_factor(4, 10, linear) == pytest.approx(0.5)
    assert lr_factor(7, 10, LRScheduler(warmup_steps=2, decay="constant")) == 1.0
    wsd = LRScheduler(warmup_steps=2, decay="wsd", min_lr_ratio=0.0, wsd_decay_ratio=0.2)
    assert [lr_factor(s, 10, wsd) for s in range(2, 10)] == pytest.approx([1, 1, 1, 1, 1, 1, 0.5, 0.0])


def test_the_gradient_norm_is_exact_to_fp64_and_clips_to_the_bound():
    """A 1M-element gradient, where an fp32 norm is ~1e-5 off: the norm is the fp64 norm of the fp32 values
    (summed exactly by math.fsum), and clipping scales every gradient to it."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (1 << 20, 1000)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    exact = math.sqrt(math.fsum(x * x for p in params for x in p.grad.double().tolist()))
    grads = [p.grad.clone() for p in params]
    assert torch.linalg.vector_norm(torch.cat(grads)).item() != pytest.approx(exact, rel=1e-6)  # fp32's is not
    norm = clip_grad_norm_(params, max_norm=0.5)
    assert norm.item() == pytest.approx(exact, rel=1e-12)
    for p, g in zip(params, grads):
        assert torch.equal(p.grad, g * (0.5 / (exact + 1e-6)))


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_gives_bitwise_identical_gradients(tmp_path, mode):
    plain = tiny_trainer(tmp_path / "plain")
    checkpointed = tiny_trainer(tmp_path / mode, **{"activation_checkpoint.mode": mode})
    batches = next(plain.loader)
    assert torch.equal(
        plain.stepper.forward_backward(batches, plain.step),
        checkpointed.stepper.forward_backward(batches, checkpointed.step),
    )
    for (name, a), (_, b) in zip(plain.model_parts.named_parameters(), checkpointed.model_parts.named_parameters()):
        assert torch.equal(a.grad, b.grad), name


@pytest.mark.scenario
@pytest.mark.slow
def test_compiled_blocks_match_eager(tmp_path):
    eager = tiny_trainer(tmp_path / "eager")
    compiled = tiny_trainer(tmp_path / "compiled", **{"compile.enable": "true"})
    batches = next(eager.loader)
    # Inductor fuses and reorders fp32 arithmetic. Measured: loss 6e-8 relative, gradients 5.2e-7 of their
    # tensor's largest element; bounds ~5x that.
    torch.testing.assert_close(
        compiled.stepper.forward_backward(batches, compiled.step),
        eager.stepper.forward_backward(batches, eager.step),
        rtol=5e-7,
        atol=0,
    )
    for (name, a), (_, b) in zip(eager.model_parts.named_parameters(), compiled.model_parts.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=3e-6 * a.grad.abs().max().item(), msg=name)


@pytest.mark.slow
def test_compiled_blocks_with_checkpointing_match_compiled_blocks_without(tmp_path):
    """Full checkpointing recomputes the compiled block: bitwise its gradients. Selective checkpointing's policy is
    traced into the block's graph (torch.utils.checkpoint in its forward, where the composable checkpoint's dispatch
    mode would cache buffers the compiled kernels reuse), which inductor then fuses otherwise: measured loss 1.2e-7
    relative and gradients 6.5e-7 of their tensor's largest element, within test_compiled_blocks_match_eager's
    bounds."""
    compiled = {"compile.enable": "true"}
    plain = tiny_trainer(tmp_path / "plain", **compiled)
    batches = next(plain.loader)
    loss = plain.stepper.forward_backward(batches, plain.step)
    full = tiny_trainer(tmp_path / "full", **compiled, **{"activation_checkpoint.mode": "full"})
    assert torch.equal(full.stepper.forward_backward(batches, full.step), loss)
    for (name, a), (_, b) in zip(plain.model_parts.named_parameters(), full.model_parts.named_parameters()):
        assert torch.equal(a.grad, b.grad), name
    selective = tiny_trainer(tmp_path / "selective", **compiled, **{"activation_checkpoint.mode": "selective"})
    torch.testing.assert_close(selective.stepper.forward_backward(batches, selective.step), loss, rtol=5e-7, atol=0)
    for (name, a), (_, b) in zip(plain.model_parts.named_parameters(), selective.model_parts.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=3e-6 * a.grad.abs().max().item(), msg=name)


def test_profiling_traces_its_window_and_the_step_breakdown_adds_up(tmp_path):
    profiling = {"profiling.enable": "true", "profiling.memory": "true", "profiling.step_breakdown": "true"}
    tiny_trainer(tmp_path, **{"training.steps": "6", "checkpoint.enable": "false", **profiling}).train()
    # wait 1, warmup 1, active 2: steps 3 and 4 are traced, written after step 4.
    traces = sorted((tmp_path / "debug" / "profiling").glob("*.pt.trace.json"))
    assert [t.name for t in traces] == ["rank0-step4.pt.trace.json"]
    events = json.loads(traces[0].read_text())["traceEvents"]  # what Perfetto and TensorBoard read
    names = {e.get("name", "") for e in events}
    assert {"ProfilerStep#2", "ProfilerStep#3"} <= names and "ProfilerStep#1" not in names
    assert {"aten::mm", "aten::scaled_dot_product_attention"} <= names  # the step's own ops
    assert any(n.startswith("Optimizer.step#AdamW") for n in names)
    assert any(e.get("name") == "[memory]" for e in events)  # allocation events: what torch has on CPU
    # The summary splits the traced steps' wall time: the shares cover it, and a one-process step's time is
    # mostly its own operators (matmuls first), with no collective.
    shares = json.loads((tmp_path / "debug" / "profiling" / "rank0-step4.summary.json").read_text())
    assert abs(sum(shares.values()) - 1) < 1e-6 and shares["collectives"] == 0
    assert shares["matmul"] > 0.1 and shares["outside ops"] < 0.5, shares
    for record in read_metrics(tmp_path / "debug")[1:]:  # the first step also starts the profiler
        phases = sum(record[f"{p}_s"] for p in ("data", "forward", "backward", "optimizer"))
        assert abs(phases - record["step_time_s"]) < 0.1 * record["step_time_s"], record


def cross_entropy_after_a_raising_loss_block(context: str):
    """On one rank: a replicated DTensor's cross-entropy after a loss block that raised, in titan's loss context or
    torch's own loss_parallel(); and the plain tensor's."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    from titan.train.step import StepRules

    mesh = init_device_mesh("cpu", (1,))
    rules = StepRules(True, False, None, None, None, (), (), math.inf, False)  # loss parallel on
    logits, target = torch.randn(6, 10, generator=torch.Generator().manual_seed(0)), torch.arange(6)
    try:
        with rules.loss_context() if context == "titan" else loss_parallel():
            raise ValueError("a step that fails inside its loss")
    except ValueError:
        pass
    replicated = [distribute_tensor(t, mesh, [Replicate()]) for t in (logits, target)]
    try:
        got = float(F.cross_entropy(*replicated).full_tensor())
    except ValueError as e:  # torch's own leaves its loss-parallel ops on, which take the logits as split by class
        got = str(e)
    return got, float(F.cross_entropy(logits, target))


@pytest.mark.distributed
def test_a_loss_that_raises_under_loss_parallel_leaves_the_next_losses_alone():
    """torch's loss_parallel() turns its ops off only when its block ends without raising: afterwards a replicated
    cross-entropy in the same process is taken for a split one. titan's loss context turns them off however it
    ends."""
    from distributed import run_distributed

    [(got, want)] = run_distributed(cross_entropy_after_a_raising_loss_block, 1, "titan")
    assert got == pytest.approx(want, rel=1e-6)
    [(polluted, _)] = run_distributed(cross_entropy_after_a_raising_loss_block, 1, "torch")
    assert "loss_parallel() requires exactly one mesh dim to shard tensor dimension 1" in polluted
