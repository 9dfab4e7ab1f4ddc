"""Checkpoints: bitwise resume, crash safety, resharding on load, and clear errors for bad checkpoints."""

import io
import math
import os
import signal
import struct
import subprocess
import sys
import zipfile

import pytest
import torch

from conftest import DEBUG_RECIPE, ROOT, run_titan, tiny_overrides
from distributed import run_distributed
from helpers import SAVED, SMALL, assert_one_line_error, start_long_run, straight_and_resumed, trainer_for
from runs import trained_run
from titan.checkpoint.checkpointer import Checkpointer, RunRecord
from titan.checkpoint.format import single_process_quiet
from titan.checkpoint.resume import complete_checkpoints
from titan.rng.shards import full_tensor
from titan.train.step import StepHook


@pytest.mark.smoke
def test_resume_is_bitwise_identical_to_training_straight_through(tmp_path):
    straight, resumed, weights_straight, weights_resumed = straight_and_resumed(tmp_path)
    assert len(straight) == len(resumed) == 10
    assert straight == resumed  # bitwise: same data order, optimizer state, lr and dropout masks
    for name, value in weights_straight.items():
        assert torch.equal(weights_resumed[name], value), name


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    "layout", [{"parallel.dp_shard": "2", "training.local_batch_size": "2"}, {"parallel.pp": "2"}], ids=["fsdp2", "pp2"]
)
def test_resume_under_fsdp2_and_pp2_is_bitwise_identical(tmp_path, layout):
    results = run_distributed(straight_and_resumed, 2, tmp_path, layout)
    straight, resumed, weights_straight, weights_resumed = results[0]
    assert straight == resumed
    for name, value in weights_straight.items():
        assert torch.equal(weights_resumed[name], value), name


def _stop_signalled_on_rank_1(root):
    """Train with rank 1 alone receiving a stop signal after step 3; returns (stop step, signal, votes)."""
    import torch.distributed as dist

    from titan.config import load_config
    from titan.train.step import StepHook
    from titan.train.stop import Preempted, StopVote
    from titan.train.trainer import Trainer

    votes = []

    class SignalOnRank1(StepHook):
        def step(self, step, batches, run):
            if step == 3 and dist.get_rank() == 1:
                trainer.stop.request("SIGTERM")
            return run(batches)

    class CountedVote(StopVote):
        def agreed(self, at_step, seconds):
            before = self.next_vote
            stop = super().agreed(at_step, seconds)
            votes.extend([at_step] * (self.next_vote != before))
            return stop

    overrides = {"parallel.dp_shard": "2", "training.local_batch_size": "2", "training.steps": "60"}
    trainer = Trainer(load_config(DEBUG_RECIPE, tiny_overrides(root, **{**SMALL, **overrides})), SignalOnRank1(),
                      CountedVote)  # fmt: skip
    with pytest.raises(Preempted) as stopped:
        trainer.train()
    return trainer.step, trainer.stop.reason, votes, str(stopped.value)


@pytest.mark.distributed
def test_a_signal_on_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    (step0, signal0, votes0, message), (step1, signal1, votes1, _) = run_distributed(
        _stop_signalled_on_rank_1, 2, tmp_path
    )
    assert step0 == step1 >= 4 and votes0 == votes1 and votes0[-1] == step0
    assert signal0 == "another rank's signal" and signal1 == "SIGTERM"
    assert f"at step {step0}; checkpoint saved" in message
    # The ranks vote at the first step, then about once a second: the next vote is never later than that.
    assert votes0[0] == 1


def test_a_stop_asked_for_during_the_last_step_ends_the_run_as_finished(tmp_path, capsys):
    """SIGTERM during the last step (a time limit as the final save begins): the final checkpoint is written once
    and the run ends as finished (exit 0 from the CLI), not preempted (exit 75, which a batch script requeues)."""

    class SignalAtTheEnd(StepHook):
        def step(self, step, batches, run):
            if step == 3:
                trainer.stop.request("SIGTERM")
            return run(batches)

    trainer = trainer_for(tmp_path, SignalAtTheEnd(), **{"training.steps": "4"})
    trainer.train()
    assert trainer.step == 4 and complete_checkpoints(tmp_path / "debug" / "checkpoints").keys() == {4}
    err = capsys.readouterr().err
    assert err.count("checkpoint step 4: ") == 1 and "run summary: steps 1-4 of 4" in err, err[-2000:]


@pytest.mark.distributed
def test_async_save_under_fsdp2_resumes_bitwise(tmp_path):
    results = run_distributed(
        straight_and_resumed,
        2,
        tmp_path,
        {
            "parallel.dp_shard": "2",
            "training.local_batch_size": "2",
            "checkpoint.async_save": "true",
            "checkpoint.interval": "2",
        },
    )
    straight, resumed, _, _ = results[0]
    assert straight == resumed


def test_keep_latest_k_prunes_old_checkpoints(tmp_path):
    trainer_for(tmp_path, **{"checkpoint.interval": "2", "checkpoint.keep_latest_k": "2"}).train()
    assert sorted(complete_checkpoints(tmp_path / "debug" / "checkpoints")) == [8, 10]


KILL_DURING_SAVE = """
import os, signal, sys
import torch.distributed.checkpoint as dcp
sys.path.insert(0, {tests!r})
from helpers import trainer_for
from pathlib import Path

real_save = dcp.save
def save_then_die(state, storage_writer, **kwargs):
    real_save(state, storage_writer=storage_writer, **kwargs)
    if str(storage_writer.path).endswith("step-4"):  # the shards are written...
        Path(storage_writer.path, "__0_0.distcp").write_bytes(b"half")  # ...one is half-overwritten...
        os.kill(os.getpid(), signal.SIGKILL)  # ...and the process dies before the checkpoint is complete
dcp.save = save_then_die
trainer_for(Path({root!r}), **{{"checkpoint.interval": "2"}}).train()
"""


def test_kill_during_save_keeps_the_previous_checkpoint(tmp_path):
    script = KILL_DURING_SAVE.format(tests=str(ROOT / "tests"), root=str(tmp_path))
    killed = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    folder = tmp_path / "debug" / "checkpoints"
    assert sorted(complete_checkpoints(folder)) == [2] and (folder / ".tmp-step-4").exists()
    resumed = run_titan("train", "--config", str(DEBUG_RECIPE), *tiny_overrides(tmp_path, **SMALL))
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {folder / 'step-2'}" in resumed.stderr
    assert not (folder / ".tmp-step-4").exists()
    assert sorted(complete_checkpoints(folder))[-1] == 10


def test_sigterm_saves_and_exits_75_then_resumes(tmp_path):
    proc = start_long_run(tmp_path)
    proc.send_signal(signal.SIGTERM)
    rest = proc.stderr.read()
    assert proc.wait(timeout=120) == 75, rest
    assert "stopped by SIGTERM" in rest and "run the same command to resume" in rest
    (step,) = complete_checkpoints(tmp_path / "debug" / "checkpoints")
    assert step >= 1


def test_ctrl_c_saves_and_exits_130(tmp_path):
    proc = start_long_run(tmp_path)
    proc.send_signal(signal.SIGINT)
    rest = proc.stderr.read()
    assert proc.wait(timeout=120) == 130, rest
    assert "Ctrl-C again to quit at once" in rest  # said as soon as it is pressed
    assert "stopped by SIGINT" in rest and "run the same command to resume" in rest
    (step,) = complete_checkpoints(tmp_path / "debug" / "checkpoints")
    assert step >= 1


class CtrlCAtStep(StepHook):
    """Presses Ctrl-C (sends this process SIGINT) during step `step`."""

    def __init__(self, step: int):
        self.at = step

    def step(self, step, batches, run):
        if step + 1 == self.at:
            os.kill(os.getpid(), signal.SIGINT)
        return run(batches)


def test_a_second_ctrl_c_while_saving_quits_at_once_keeping_the_last_checkpoint(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    real_save = dcp.save

    def save_then_ctrl_c(state, storage_writer, **kwargs):
        real_save(state, storage_writer=storage_writer, **kwargs)
        if str(storage_writer.path).endswith("step-3"):  # the stop's save has written its shards, not sealed them
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(dcp, "save", save_then_ctrl_c)
    trainer = trainer_for(tmp_path, CtrlCAtStep(3), **{"checkpoint.interval": "2"})
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert trainer.step == 3
    folder = tmp_path / "debug" / "checkpoints"
    assert sorted(complete_checkpoints(folder)) == [2] and (folder / ".tmp-step-3").exists()
    assert trainer_for(tmp_path).step == 2  # resumes from the last complete checkpoint


def reshard_job(root, layout: dict, batch):
    """Load the checkpoint saved under FSDP2 with another layout; logits on `batch`, then train on."""
    saved = str(root / "saved" / "debug" / "checkpoints")
    # The saved run was 4 steps long; this one continues it.
    trainer = trainer_for(
        root / "load", **{"checkpoint.resume": saved, "checkpoint.allow_changes": "training.steps", **layout}
    )
    trainer.model_parts.parts[0].eval()
    with torch.no_grad():
        logits = trainer.model_parts.parts[0](batch)
    logits = full_tensor(logits)
    step = trainer.step
    losses = trainer.train(until=step + 2)
    return step, logits, losses


def save_under_fsdp2(root, batch):
    trainer = trainer_for(
        root / "saved", **{"parallel.dp_shard": "2", "training.local_batch_size": "2", "training.steps": "4"}
    )
    trainer.train()
    trainer.model_parts.parts[0].eval()
    with torch.no_grad():
        return trainer.model_parts.parts[0](batch)


@pytest.mark.distributed
@pytest.mark.slow
def test_checkpoint_saved_under_fsdp2_loads_under_tp2_and_one_process(tmp_path):
    batch = torch.randint(0, 1000, (2, 32))
    (saved_logits, _) = run_distributed(save_under_fsdp2, 2, tmp_path, batch)
    tp = run_distributed(reshard_job, 2, tmp_path, {"parallel.tp": "2", "parallel.dp_shard": "1"}, batch)[0]
    single = reshard_job(tmp_path, {}, batch)
    for step, logits, losses in (tp, single):
        assert step == 4
        # Same weights; the layouts only sum in other orders (fp32).
        torch.testing.assert_close(logits, saved_logits, rtol=1e-5, atol=1e-5)
        assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))


def test_load_only_model_starts_a_new_run_from_the_weights(tmp_path):
    source = trainer_for(tmp_path / "source", **{"training.steps": "3"})
    source.train()
    fresh = trainer_for(
        tmp_path / "finetune",
        **{
            "checkpoint.resume": str(tmp_path / "source" / "debug" / "checkpoints" / "step-3"),
            "checkpoint.load_only": '["model"]',
        },
    )
    assert fresh.step == 0
    assert all(float(s["step"]) == 0 for s in fresh.optimizer.state.values())  # no optimizer state was loaded
    for (name, a), (_, b) in zip(source.model_parts.named_parameters(), fresh.model_parts.named_parameters()):
        assert torch.equal(a, b), name


@pytest.fixture(scope="module")
def saved_run():
    return trained_run(**SAVED) / "debug" / "checkpoints" / "step-2"


def train_resuming(tmp_path, checkpoint, **extra):
    """`titan train` of the saved run's recipe, resuming from `checkpoint`."""
    overrides = tiny_overrides(tmp_path, **{**SMALL, **SAVED, **extra, "checkpoint.resume": str(checkpoint)})
    return run_titan("train", "--config", str(DEBUG_RECIPE), *overrides)


def test_an_older_titans_checkpoint_upgrades_once_and_resumes_as_the_original(tmp_path, saved_run):
    """An older titan wrote the same shards with DCP's own writer, whose index is a pickled .metadata. After
    `titan convert upgrade` it resumes exactly as the checkpoint it was made from."""
    import shutil

    import torch.distributed.checkpoint as dcp

    from titan.checkpoint.format import INDEX, seal

    older = tmp_path / "older" / "step-2"
    loaded = trainer_for(tmp_path / "load", **SAVED, **{"checkpoint.resume": str(saved_run)})
    with single_process_quiet():
        dcp.save(loaded.checkpointer.tensor_state(("model", "optimizer")), checkpoint_id=str(older), no_dist=True)
    for name in ("train_state.json", "data.json"):
        shutil.copy(saved_run / name, older / name)
    seal(older)
    assert (older / ".metadata").is_file() and not (older / INDEX).exists()
    assert_one_line_error(train_resuming(tmp_path / "refused", older), "older titan", "titan convert upgrade")

    upgraded = run_titan("convert", "upgrade", str(older.parent))  # a folder of checkpoints: each of them
    assert upgraded.returncode == 0 and "upgraded" in upgraded.stdout, upgraded.stderr
    assert (older / INDEX).is_file() and not (older / ".metadata").exists()
    again = run_titan("convert", "upgrade", str(older))
    assert again.returncode == 0 and "current format already" in again.stdout, again.stderr

    continued = {**SAVED, "training.steps": "4", "checkpoint.allow_changes": "training.steps"}
    runs = [trainer_for(tmp_path / name, **continued, **{"checkpoint.resume": str(path)})
            for name, path in (("original", saved_run), ("upgraded", older))]  # fmt: skip
    assert runs[0].step == runs[1].step == 2
    assert runs[0].train() == runs[1].train()  # bitwise
    for (name, a), (_, b) in zip(runs[0].model_parts.named_parameters(), runs[1].model_parts.named_parameters()):
        assert torch.equal(a, b), name


def test_truncated_checkpoint_is_a_clear_error(tmp_path, saved_run):
    broken = tmp_path / "broken"
    subprocess.run(["cp", "-r", str(saved_run), str(broken)], check=True)
    shard = broken / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])
    result = train_resuming(tmp_path, broken)
    assert_one_line_error(result, str(broken), "__0_0.distcp has", "bytes", "were saved")
    # Without the manifest check, DCP's own reading still refuses it.
    result = train_resuming(tmp_path, broken, **{"checkpoint.verify": "false"})
    assert_one_line_error(result, "checkpoint", "corrupt")


def test_checkpoint_of_another_model_is_a_clear_error(tmp_path, saved_run):
    result = train_resuming(tmp_path, saved_run, **{"model.overrides.n_layers": "3"})
    assert_one_line_error(result, "does not match", "parameters differ")


def test_empty_checkpoint_folder_with_resume_path_is_a_clear_error(tmp_path):
    (tmp_path / "empty").mkdir()
    result = train_resuming(tmp_path, tmp_path / "empty")
    assert_one_line_error(result, "checkpoint.resume", "not a complete titan checkpoint")


def test_a_checkpointer_saves_and_restores_the_parts_it_is_given_without_a_trainer(tmp_path):
    """The checkpointer needs only its collaborators: a plain model, an optimizer, a schedule, a loader."""
    from helpers import numbered_documents
    from titan.config import Checkpoint, LRScheduler
    from titan.config import Optimizer as OptimizerConfig
    from titan.data.loader import Blend, GlobalBatchLoader, PackedSamples
    from titan.optim import build_lr_scheduler, build_optimizer
    from titan.parallel.parallelize import ModelParts

    def parts(seed: int):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        optimizer = build_optimizer([model], OptimizerConfig(lr=0.1))
        scheduler = build_lr_scheduler(optimizer, LRScheduler(warmup_steps=2), total_steps=10)
        docs = numbered_documents(20)
        loader = GlobalBatchLoader(
            [PackedSamples(docs, range(20), 7, 0, True)], Blend([1.0]), 4, range(4), [2, 2], True
        )
        checkpointer = Checkpointer(
            Checkpoint(interval=1),
            tmp_path / "checkpoints",
            {"model": ModelParts([model], [0], 1), "optimizer": optimizer, "lr_scheduler": scheduler, "data": loader},
            RunRecord(
                {"name": "toy", "flavor": "-", "shapes": {n: list(p.shape) for n, p in model.named_parameters()}}, ""
            ),
            rank=0,
            save_group=None,  # one process: no collectives
            control_group=None,
        )
        return model, optimizer, scheduler, loader, checkpointer

    model, optimizer, scheduler, loader, checkpointer = parts(seed=0)
    for _ in range(3):
        next(loader)
        model(torch.randn(3, 4)).square().sum().backward()
        optimizer.step()
        scheduler.step()
    assert checkpointer.save(3, tokens_seen=96, loss=1.0) is not None
    fresh_model, fresh_optimizer, fresh_scheduler, fresh_loader, fresh = parts(seed=1)
    assert fresh.resume() == 3
    for (name, a), b in zip(model.named_parameters(), fresh_model.parameters()):
        assert torch.equal(a, b), name
        for key, value in optimizer.state[a].items():
            assert torch.equal(fresh_optimizer.state[b][key], value), (name, key)
    assert fresh_scheduler.get_last_lr() == scheduler.get_last_lr()
    assert [g["lr"] for g in fresh_optimizer.param_groups] == [g["lr"] for g in optimizer.param_groups]
    assert fresh_loader.next_sample == loader.next_sample == 12


def test_a_blocking_save_and_a_load_report_their_bytes(tmp_path, monkeypatch, capsys):
    """Where stderr is a log file, a save that blocks and a load log their progress (here at every tensor): the
    save counts every tensor it writes, the load every byte range of the checkpoint's files it reads."""
    import json

    from tqdm import tqdm

    from titan import progress
    from titan.checkpoint.format import INDEX

    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.0)
    size = lambda n: tqdm.format_sizeof(n, "B", 1024)  # noqa: E731
    trainer = trainer_for(tmp_path, **SAVED)
    trainer.train()
    optimizer_state = [v for state in trainer.optimizer.state.values() for v in state.values()]
    saved = sum(t.numel() * t.element_size() for t in [*trainer.model_parts.parameters(), *optimizer_state])
    lines = [line.split(" ", 1)[1] for line in capsys.readouterr().err.splitlines()]
    saving = [line for line in lines if line.startswith("checkpoint step 2: saving: ")]
    assert saving[-2].startswith(f"checkpoint step 2: saving: {size(saved)} of {size(saved)} (100%)"), saving
    assert saving[-1].startswith("checkpoint step 2: saving: done")

    assert trainer_for(tmp_path, **SAVED).step == 2
    folder = tmp_path / "debug" / "checkpoints" / "step-2"
    index = json.loads((folder / INDEX).read_text())["tensors"]
    read = sum(chunk["length"] for entry in index.values() for chunk in entry["chunks"])
    loading = [line.split(" ", 1)[1] for line in capsys.readouterr().err.splitlines() if "loading checkpoint" in line]
    assert loading[-2].startswith(f"loading checkpoint step-2: {size(read)} of {size(read)} (100%)"), loading
    assert loading[-1].startswith("loading checkpoint step-2: done")


def _boxes_index(shape: list[int], boxes: list[tuple[list[int], list[int]]]) -> dict:
    """A tensors.json of one fp32 tensor of `shape` saved in chunks (offsets, sizes), each over the same bytes."""
    from titan.checkpoint.format import FORMAT, VERSION

    length = 4 * math.prod(shape)
    chunks = [{"offsets": o, "sizes": s, "file": "__0_0.distcp", "start": 0, "length": length} for o, s in boxes]
    tensor = {"dtype": "float32", "shape": shape, "chunks": chunks}
    return {"format": FORMAT, "version": VERSION, "tensors": {"t": tensor}}


GRID = [([r, c], [1, 1]) for r in range(128) for c in range(128)]  # 16,384 chunks: pairs would be 1.3e8
TILINGS = {
    "2-D grid": ([4, 6], [([0, 0], [2, 3]), ([0, 3], [2, 3]), ([2, 0], [2, 3]), ([2, 3], [2, 3])]),
    "pinwheel, no grid": ([4, 4], [([0, 0], [1, 3]), ([0, 3], [3, 1]), ([3, 1], [1, 3]), ([1, 0], [3, 1]),
                                   ([1, 1], [2, 2])]),
    "an empty chunk": ([4, 2], [([0, 0], [4, 2]), ([2, 0], [0, 2])]),
    "a scalar": ([], [([], [])]),
    "many chunks": ([128, 128], GRID),
}  # fmt: skip
OCTANTS = [([a, b, c], [1, 1, 1]) for a in (0, 1) for b in (0, 1) for c in (0, 1)]
OVERLAPS = {
    "the same half twice": ([4, 6], [([0, 0], [2, 6]), ([0, 0], [2, 6])]),
    "2-D boxes sharing a cell": ([3, 3], [([0, 0], [2, 2]), ([1, 1], [2, 2]), ([0, 2], [1, 1])]),
    "3-D, an octant twice": ([2, 2, 2], [*OCTANTS[:-1], OCTANTS[0]]),
    "many chunks, one moved": ([128, 128], [*GRID[:-1], ([5, 7], [1, 1])]),
}


@pytest.mark.parametrize("shape,boxes", TILINGS.values(), ids=TILINGS.keys())
def test_chunks_that_tile_their_tensor_are_read(shape, boxes, tmp_path):
    from titan.checkpoint.format import metadata_of

    metadata = metadata_of(_boxes_index(shape, boxes), {"__0_0.distcp": 4 * math.prod(shape)}, tmp_path)
    assert len(metadata.state_dict_metadata["t"].chunks) == len(boxes)


@pytest.mark.parametrize("shape,boxes", OVERLAPS.values(), ids=OVERLAPS.keys())
def test_chunks_that_overlap_are_refused_though_their_elements_add_up(shape, boxes, tmp_path):
    """Elements covered twice and others never, in the same count: a volume check passes them, a reader would
    leave the others as the memory they were loaded into held."""
    from titan.checkpoint.format import metadata_of
    from titan.errors import ConfigError

    assert sum(math.prod(sizes) for _, sizes in boxes) == math.prod(shape)
    with pytest.raises(ConfigError, match="overlap"):
        metadata_of(_boxes_index(shape, boxes), {"__0_0.distcp": 4 * math.prod(shape)}, tmp_path)


def _saved(tensor: torch.Tensor) -> bytes:
    plain = io.BytesIO()
    torch.save(tensor, plain)
    return plain.getvalue()


def _rezipped(archive: bytes, compression: int = zipfile.ZIP_STORED) -> bytes:
    """The archive's records written anew by Python's zipfile."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(archive)) as saved, zipfile.ZipFile(out, "w", compression) as packed:
        for info in saved.infolist():
            packed.writestr(info.filename, saved.read(info))
    return out.getvalue()


def _storage_listed_twice(saved: bytes) -> bytes:
    """The archive (rewritten by zipfile: no zip64 records) with a second directory entry, data/1, for the storage
    record data/0: one record's bytes, two records' sizes."""
    archive = _rezipped(saved)
    end = archive.rindex(zipfile.stringEndArchive)
    sig, disk, disk_dir, count, total, size, offset, _ = struct.unpack(zipfile.structEndArchive, archive[end:])
    at = archive.rindex(zipfile.stringCentralDir, offset, archive.index(b"archive/data/0", offset))
    fields = struct.unpack(zipfile.structCentralDir, archive[at : at + zipfile.sizeCentralDir])
    entry = archive[at : at + zipfile.sizeCentralDir + sum(fields[12:15])]  # name, extra and comment lengths
    copy = entry.replace(b"archive/data/0", b"archive/data/1")
    tail = struct.pack(zipfile.structEndArchive, sig, disk, disk_dir, count + 1, total + 1, size + len(copy), offset, 0)
    return archive[:end] + copy + tail


def test_chunk_archives_as_torch_save_writes_them_pass():
    from titan.checkpoint.format import archive_problem

    saved = _saved(torch.arange(8.0))  # with zip64 end records, as torch.save writes every archive
    for archive in (saved, _rezipped(saved)):  # and without them
        for before in (b"", b"the chunks before it"):  # a chunk inside its file
            assert archive_problem(io.BytesIO(before + archive), len(before), len(archive)) is None
        assert torch.equal(torch.load(io.BytesIO(archive), weights_only=True), torch.arange(8.0))


ARCHIVES = {
    "deflated storage": (lambda saved: _rezipped(saved, zipfile.ZIP_DEFLATED), "holds compressed records"),
    "bytes before it": (lambda saved: b"\0" * 64 + saved, "not where its end record says"),
    "a comment after it": (lambda saved: saved[:-2] + b"\3\0abc", "not where its end record says"),
    "the storage listed twice": (_storage_listed_twice, "declares records of"),
    "truncated": (lambda saved: saved[:100], "not where its end record says"),
}


@pytest.mark.parametrize("craft,words", ARCHIVES.values(), ids=ARCHIVES.keys())
def test_chunk_archives_that_torch_load_would_read_past_their_bytes_are_refused(craft, words):
    """torch.load allocates each record at the size the zip directory declares: stored records only, no larger
    together than the chunk, in a directory that zipfile and torch's zip reader find alike."""
    from titan.checkpoint.format import archive_problem

    archive = craft(_saved(torch.zeros(2**16)[:64]))
    assert words in archive_problem(io.BytesIO(archive), 0, len(archive))


def test_a_moe_checkpoint_holds_its_routing_biases_and_a_resume_restores_them(tmp_path):
    """The biases are state that each step moves outside the gradient, as the weights are: a resumed run (and
    `titan generate`, and the HF export's check) reads them from the checkpoint."""
    from titan.config import load_config
    from titan.train.trainer import Trainer

    overrides = {**SAVED, "checkpoint.enable": "true", "model.overrides.n_layers": "2"}
    config = load_config(ROOT / "recipes" / "debug_moe.toml", tiny_overrides(tmp_path, **overrides))
    trained = Trainer(config)
    trained.train()
    routers = trained.model_parts.parts[0].routing.routers()
    biases = {layer: router.expert_bias.clone() for layer, router in routers.items()}
    assert biases and all(bias.any() for bias in biases.values())
    resumed = Trainer(config)
    assert resumed.step == 2
    for layer, router in resumed.model_parts.parts[0].routing.routers().items():
        assert torch.equal(router.expert_bias, biases[layer])
