"""The watchdog ends a hung rank with one line naming the ranks it waits for, whatever the job's store holds."""

import json
import re
import time

from titan.train.recovery import watchdog


class Store:
    """The heartbeat keys of a job's TCP store."""

    def __init__(self, beats: dict):
        self.beats = beats

    def check(self, keys):
        return all(key in self.beats for key in keys)

    def get(self, key):
        return self.beats[key]

    def set(self, key, value):
        self.beats[key] = value.encode()


def test_a_hang_is_named_even_beside_heartbeats_the_watchdog_cannot_read(monkeypatch, capsys):
    """Rank 0 hangs in its backward. Rank 1 beats in step; rank 2 went silent; ranks 3 and 4's keys hold what no
    titan wrote. The thread still ends the rank with exit 1 and one line that names each."""
    now = time.time()
    store = Store({
        "titan/heartbeat/1": json.dumps([5, "backward", now + 60]).encode(),  # beating all along
        "titan/heartbeat/2": json.dumps([4, "forward", now - 60]).encode(),
        "titan/heartbeat/3": b"\xff not json",
        "titan/heartbeat/4": json.dumps({"step": 5}).encode(),
    })  # fmt: skip
    exits = []

    def exit_thread(code):
        exits.append(code)
        dog._stopped.set()  # ends the watch, as os._exit would end the process

    monkeypatch.setattr(watchdog.os, "_exit", exit_thread)
    dog = watchdog.Watchdog(0.2, rank=0, world_size=6)
    monkeypatch.setattr(dog, "_connect", lambda: store)
    dog.enter("backward", 5)
    dog.start()
    dog._thread.join(timeout=10)
    assert exits == [1]
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "hung" in line]
    assert line.startswith("titan: rank 0 hung at step 5 in backward for ") and "waiting for " in line, line
    assert "rank 2 (silent for 60s, last at step 4 in forward)" in line, line
    assert "rank 3 (a heartbeat titan cannot read: b'\\xff not json')" in line, line
    assert "rank 4 (a heartbeat titan cannot read" in line and "rank 5 (no heartbeat)" in line, line
    assert "rank 1 " not in line, line


def watch(store: Store, monkeypatch, silence_s: float, timeout_s: float = 60.0) -> tuple[list, list]:
    """Rank 0 of 3 waiting in its backward at step 5, on `store`; returns (exit codes, what on_exit was told) once
    the watch ends (or after 10 s)."""
    exits, told = [], []
    dog = watchdog.Watchdog(timeout_s, rank=0, world_size=3, silence_s=silence_s, on_exit=lambda *why: told.append(why))

    def exit_thread(code):
        exits.append(code)
        dog._stopped.set()

    monkeypatch.setattr(watchdog.os, "_exit", exit_thread)
    monkeypatch.setattr(dog, "_connect", lambda: store)
    dog.enter("backward", 5)
    dog.start()
    dog._thread.join(timeout=10)
    dog.close()
    return exits, told


def test_a_rank_waiting_on_a_silent_next_rank_exits_long_before_the_step_timeout(monkeypatch, capsys):
    """The next rank (1) last beat 30 s ago: once rank 0 has waited peer_silence_s (0.5 s here; the step timeout
    is a minute), it exits naming rank 1, and says why to whoever records it."""
    store = Store({"titan/heartbeat/1": json.dumps([5, "backward", time.time() - 30]).encode()})
    start = time.monotonic()
    exits, told = watch(store, monkeypatch, silence_s=0.5)
    assert exits == [1] and time.monotonic() - start < 10
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("titan: rank 0")]
    assert re.match(r"titan: rank 0 waited at step 5 in backward on rank 1, silent for 3\ds ", line), line
    assert "(fault.peer_silence_s = 0.5: its process or node lost)" in line, line
    assert told == [(5, line.removeprefix("titan: rank 0 ").split("; exiting so that")[0])]


def test_a_next_rank_that_beats_is_waited_for(monkeypatch):
    """Rank 1 beats on (a long collective, a slow save): rank 0 waits past peer_silence_s, until the step timeout
    (2 s here)."""
    store = Store({"titan/heartbeat/1": json.dumps([5, "backward", time.time() + 60]).encode()})
    start = time.monotonic()
    exits, _ = watch(store, monkeypatch, silence_s=0.3, timeout_s=2.0)
    assert exits == [1] and time.monotonic() - start >= 2.0
