"""Why a run restarted: the failed generation's records, read into the restart's one line."""

from titan.train.recovery import failures


def test_the_restart_line_says_which_ranks_failed_how_and_which_said_nothing(tmp_path, monkeypatch):
    """Generation 0 of a 4-rank run: rank 0 lost a peer at step 6, rank 2 failed on its own, ranks 1 and 3 were
    killed. A record of an older generation is not this restart's news."""
    error = RuntimeError(
        "[/__w/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:11648: Connection reset by peer."
    )
    assert failures.peer_lost(error) and not failures.peer_lost(RuntimeError("CUDA out of memory"))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    failures.record(tmp_path, 0, 4, 6, f"lost a peer ({failures.first_line(error)})")
    failures.record(tmp_path, 2, 4, 5, failures.first_line(ValueError("bad batch\nmore")))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "7")
    failures.record(tmp_path, 3, 4, 1, "long ago")
    assert failures.why_restarted(tmp_path, 1) == (
        "ranks 1, 3 wrote nothing (killed, or the node lost); "
        "rank 0 at step 6: lost a peer (Read error [127.0.0.1]:11648: Connection reset by peer.); "
        "rank 2 at step 5: bad batch"
    )
    assert failures.why_restarted(tmp_path / "elsewhere", 1) == "no worker wrote why (killed, or their nodes lost)"
