"""Why a run restarted: the failed generation's records, read into the restart's one line."""

from titan.train.recovery import failures


def test_the_restart_line_says_which_ranks_stopped_how_and_which_said_nothing(tmp_path, monkeypatch, caplog):
    """Before restart 1 of a 4-rank run: rank 0 lost a peer at step 6, rank 2 failed on its own, ranks 1 and 3 were
    killed. The restart's line says so, and rank 0 clears the records: a later restart (a node joining, which
    torchrun does not count) is told only what came after."""
    error = RuntimeError(
        "[/__w/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:11648: Connection reset by peer."
    )
    assert failures.peer_lost(error) and not failures.peer_lost(RuntimeError("CUDA out of memory"))
    failures.record(tmp_path, 0, 4, 6, f"lost a peer ({failures.first_line(error)})")
    failures.record(tmp_path, 2, 4, 5, failures.first_line(ValueError("bad batch\nmore")))
    not_titans = '{"rank": "9", "world": 4, "what": "x"}'  # a rank that is text: skipped
    (tmp_path / failures.FOLDER / "rank-9.json").write_text(not_titans)
    logged = []
    metrics = type("Metrics", (), {"log": lambda self, step, record: logged.append((step, record))})()
    with caplog.at_level("INFO", logger="titan"):
        failures.log_restart(metrics, 1, 5, 0, 2, "dp_shard2", tmp_path)
    assert caplog.messages == [
        "elastic restart 1: a world of 2 (dp_shard2), continuing at step 5; before it, "
        "ranks 1, 3 wrote nothing (killed, or the node lost); "
        "rank 0 at step 6: lost a peer (Read error [127.0.0.1]:11648: Connection reset by peer.); "
        "rank 2 at step 5: bad batch"
    ]
    assert logged == [(5, {"elastic_restart": 1, "world_size": 2})]
    assert failures.why_restarted(tmp_path) == "no worker wrote why (killed, or their nodes lost)"


def test_a_rank_reading_the_records_as_rank_0_clears_them_reads_none(tmp_path, monkeypatch):
    """Every rank builds the restart's line while rank 0 removes the folder: pathlib lists it after checking it is
    a directory, so the folder can vanish in between. That once failed rank 1 at start-up (FileNotFoundError), which
    cost the run a restart of its own."""
    import os
    import pathlib

    failures.record(tmp_path, 1, 2, 3, "killed")
    folder, scandir = tmp_path / failures.FOLDER, os.scandir

    def removed_first(path):
        if pathlib.Path(path) == folder:
            raise FileNotFoundError(2, "No such file or directory", str(folder))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", removed_first)
    monkeypatch.setattr(pathlib.Path, "_scandir", lambda self: removed_first(self), raising=False)
    assert failures.why_restarted(tmp_path) == "no worker wrote why (killed, or their nodes lost)"
