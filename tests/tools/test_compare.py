"""`titan compare` on real runs, the run folder's tracking files, and clear errors for broken folders."""

import dataclasses
import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import matplotlib.image
import pytest

from conftest import DEBUG_RECIPE, run_titan, tiny_overrides
from titan.config import load_config
from titan.tools.compare import CompareError, figure, load_run, short_number, wall_time_s

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two real 3-step runs of the debug recipe, trained side by side: b has another lr and seq_len."""
    out = tmp_path_factory.mktemp("runs")
    common = {"training.steps": "3", "training.local_batch_size": "2", "model.overrides.n_layers": "1"}
    variants = {
        "a": {"validation.interval": "2", "validation.fraction": "0.1", "validation.steps": "1"},
        "b": {"optimizer.lr": "1e-3", "training.seq_len": "32"},
    }

    def train(name):
        overrides = tiny_overrides(out, **common, **{"job.name": name}, **variants[name])
        return run_titan("train", "--config", str(DEBUG_RECIPE), *overrides, env={"OMP_NUM_THREADS": "1"}, timeout=300)

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(train, variants))
    for result in results:
        assert result.returncode == 0, result.stderr
    return out / "a", out / "b"


def section(output: str, title: str) -> dict[str, list[str]]:
    """The rows of a titled table in compare's output: first column -> the other columns."""
    lines = output.splitlines()
    start = lines.index(title) + 2  # skip the title and the header row
    rows = {}
    for line in lines[start:]:
        if not line.strip():
            break
        key, *values = line.split()
        rows[key] = values
    return rows


def test_compare_lists_both_runs_and_exactly_the_keys_that_differ(runs, tmp_path):
    a, b = runs
    plot = tmp_path / "curves.png"
    result = run_titan("compare", str(a), str(b), "--plot", str(plot))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    header, row_a, row_b = out.splitlines()[:3]
    assert header.split()[:3] == ["run", "recipe", "job"]
    for row, run in ((row_a, a), (row_b, b)):
        metrics = [m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in m]
        cells = row.split()
        assert cells[:4] == [run.name, "debug", run.name, "single"], row
        assert "3/3" in cells
        assert f"{metrics[-1]['loss']:.4f}" in cells  # final loss
        assert f"{min(m['loss'] for m in metrics):.4f}" in cells  # min loss
        validation = [m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "val_loss" in m]
        if run == a:  # validated at steps 2 and 3 (the end); the table shows the last
            assert [m["step"] for m in validation] == [2, 3] and f"{validation[-1]['val_loss']:.4f}" in cells
        else:
            assert not validation
        assert f"{sorted(m['tokens_per_s'] for m in metrics)[1]:,.0f}" in cells  # median tokens/s

    diff = section(out, "config keys that differ:")
    assert set(diff) == {
        "job.name",
        "optimizer.lr",
        "training.seq_len",
        "validation.interval",
        "validation.fraction",
        "validation.steps",
    }, out
    assert diff["job.name"] == ['"a"', '"b"']
    assert [float(v) for v in diff["optimizer.lr"]] == [load_config(DEBUG_RECIPE).optimizer.lr, 1e-3]
    assert diff["training.seq_len"] == ["64", "32"]

    data = plot.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 20_000
    image = matplotlib.image.imread(plot)
    assert image.shape[0] >= 300 and image.shape[1] >= 900
    assert image[..., :3].std() > 0.05  # not a blank canvas: curves, axes and labels


def metrics_of(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_the_plot_has_a_panel_per_metric_against_steps_or_tokens(runs):
    a, b = runs
    loaded = [load_run(a), load_run(b)]
    for x, key in (("steps", "step"), ("tokens", "tokens_seen")):
        fig = figure(loaded, x)
        panels = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
        assert list(panels) == ["loss", "learning rate", "grad norm", "tokens/s", "MFU"]
        assert fig.axes[-1].get_legend().get_title().get_text() == "runs"  # in the grid's spare slot
        for metric, title in (("loss", "loss"), ("lr", "learning rate"), ("grad_norm", "grad norm"),
                              ("tokens_per_s", "tokens/s"), ("mfu", "MFU")):  # fmt: skip
            lines = {line.get_label(): line for line in panels[title].lines}
            for run in runs:
                logged = [m for m in metrics_of(run) if "loss" in m]
                assert list(lines[run.name].get_xdata()) == [m[key] for m in logged], (x, title)
                assert list(lines[run.name].get_ydata()) == [m[metric] for m in logged], (x, title)
        # Run a validated at steps 2 and 3: dashed, at those steps or the tokens seen by them.
        validation = lines_of(panels["loss"])["a (validation)"]
        at = {m["step"]: m[key] for m in metrics_of(a) if "loss" in m}
        assert validation.get_linestyle() == "--" and list(validation.get_xdata()) == [at[2], at[3]]
        assert list(validation.get_ydata()) == [m["val_loss"] for m in metrics_of(a) if "val_loss" in m]
        fig.canvas.draw()
        for ax in panels.values():
            for tick in ax.get_xticklabels():
                assert tick.get_text() == short_number(tick.get_position()[0]), (x, tick)


def lines_of(ax) -> dict:
    return {line.get_label(): line for line in ax.lines}


def test_tick_labels_are_short_numbers():
    assert [short_number(v) for v in (0, 0.5, 950, 1000, 12_000, 1_200_000, 1_250_000, 3e9, -2500)] == [
        "0", "0.5", "950", "1k", "12k", "1.2M", "1.25M", "3B", "-2.5k"
    ]  # fmt: skip


def test_the_plot_format_follows_the_suffix_and_mfu_only_when_logged(runs, tmp_path):
    a, b = runs
    for suffix, magic in ((".svg", b"<?xml"), (".pdf", b"%PDF")):
        result = run_titan("compare", str(a), str(b), "--plot", str(tmp_path / f"curves{suffix}"))
        assert result.returncode == 0, result.stderr
        assert (tmp_path / f"curves{suffix}").read_bytes().startswith(magic)
    result = run_titan("compare", str(a), str(b), "--plot", str(tmp_path / "curves.jpg"))
    assert result.returncode == 2 and result.stdout == "" and ".png, .svg or .pdf" in result.stderr
    no_mfu = tmp_path / "no-mfu"
    shutil.copytree(b, no_mfu)
    records = [{k: v for k, v in m.items() if k != "mfu"} for m in metrics_of(b)]
    (no_mfu / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in records))
    fig = figure([load_run(no_mfu)])
    assert [ax.get_title() for ax in fig.axes] == ["loss", "learning rate", "grad norm", "tokens/s"]
    assert fig.axes[0].get_legend() is not None  # no spare slot: the legend sits on the loss panel


def test_run_folder_describes_the_run(runs):
    a, _ = runs
    assert {"config.toml", "metrics.jsonl", "run_info.json", "tracking.json"} <= {p.name for p in a.iterdir()}
    info = json.loads((a / "run_info.json").read_text())
    for key in ("titan_version", "torch_version", "world_size", "layout", "device"):
        assert key in info, key
    tracking = json.loads((a / "tracking.json").read_text())
    assert tracking["recipe"].endswith("recipes/debug.toml") and tracking["group"] == "debug"
    assert tracking["layout"] == "single"
    assert {"recipe:debug", "layout:single", "model:llama3-debug", "world:1"} <= set(tracking["tags"])
    assert tracking["command"][:2] == ["titan", "train"]
    records = [json.loads(line) for line in (a / "metrics.jsonl").read_text().splitlines()]
    elapsed = [r["elapsed_s"] for r in records]
    assert elapsed == sorted(elapsed) and elapsed[0] > 0


@pytest.mark.parametrize(
    "breakage, message",
    [
        ("missing folder", "no such run folder"),
        ("no metrics.jsonl", "not a titan run folder: missing metrics.jsonl"),
        ("no config.toml and run_info.json", "not a titan run folder: missing config.toml, run_info.json"),
        ("bad metrics line", "metrics.jsonl line 2 is not valid JSON"),
        ("empty metrics", "metrics.jsonl has no logged steps"),
        ("record without step", "metrics.jsonl line 1 has no 'step'"),
        ("bad config.toml", "config.toml is not valid TOML"),
        ("file, not folder", "not a folder"),
    ],
)
def test_broken_run_folders_give_one_line_errors(runs, tmp_path, breakage, message):
    a, b = runs
    broken = tmp_path / "broken"
    if breakage == "file, not folder":
        broken.write_text("")
    elif breakage != "missing folder":
        shutil.copytree(a, broken)
    if breakage == "no metrics.jsonl":
        (broken / "metrics.jsonl").unlink()
    elif breakage == "no config.toml and run_info.json":
        (broken / "config.toml").unlink()
        (broken / "run_info.json").unlink()
    elif breakage == "bad metrics line":
        lines = (broken / "metrics.jsonl").read_text().splitlines()
        (broken / "metrics.jsonl").write_text("\n".join([lines[0], '{"step": 2, "loss', *lines[2:]]) + "\n")
    elif breakage == "empty metrics":
        (broken / "metrics.jsonl").write_text("")
    elif breakage == "record without step":
        (broken / "metrics.jsonl").write_text('{"loss": 1.0}\n')
    elif breakage == "bad config.toml":
        (broken / "config.toml").write_text("[job\nname = ")
    result = run_titan("compare", str(b), str(broken))
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(broken) in lines[0], result.stderr
    assert message in lines[0]


def test_plot_into_a_missing_folder_is_a_clear_error(runs, tmp_path):
    result = run_titan("compare", *map(str, runs), "--plot", str(tmp_path / "nope" / "x.png"))
    assert result.returncode == 2 and "folder" in result.stderr and "does not exist" in result.stderr


def test_torn_last_line_of_a_killed_run_is_ignored(runs, tmp_path):
    run = tmp_path / "killed"
    shutil.copytree(runs[0], run)
    torn_line = len((run / "metrics.jsonl").read_text().splitlines()) + 1
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "lo')  # the process died mid-write
    assert [r["step"] for r in load_run(run).curve] == [1, 2, 3]
    with open(run / "metrics.jsonl", "a") as f:
        f.write("\n")  # ... but a complete bad line is an error
    with pytest.raises(CompareError, match=f"line {torn_line} is not valid JSON"):
        load_run(run)


def test_wall_time_adds_up_the_segments_of_a_restarted_run():
    first = [{"step": s, "loss": 1.0, "elapsed_s": e} for s, e in ((1, 2.0), (2, 3.0), (3, 4.0))]
    resumed = [{"step": s, "loss": 1.0, "elapsed_s": e} for s, e in ((3, 1.5), (4, 2.5))]
    assert wall_time_s(first + resumed) == pytest.approx(4.0 + 2.5)
    # Older runs without elapsed_s: the logged step times, each covering the steps since the last record.
    old = [{"step": 1, "loss": 1.0, "step_time_s": 0.5}, {"step": 10, "loss": 1.0, "step_time_s": 0.1}]
    assert wall_time_s(old) == pytest.approx(0.5 + 9 * 0.1)


def test_trackers_name_group_and_tag_runs_by_recipe_and_layout(tmp_path, monkeypatch):
    import wandb

    from titan.observe import metrics

    captured = {}

    class FakeRun:
        url = None

        def log(self, *a, **k):
            pass

        def finish(self):
            pass

    def fake_init(**kwargs):
        captured.update(kwargs)
        return FakeRun()

    monkeypatch.setattr(wandb, "init", fake_init)
    overrides = [
        "--job.output_dir",
        str(tmp_path),
        "--job.name",
        "x",
        "--metrics.wandb",
        "offline",
        "--metrics.tensorboard",
        "true",
        "--metrics.wandb_tags",
        '["sweep-1"]',
    ]
    config = load_config(DEBUG_RECIPE, overrides, world_size=4)
    info = {"world_size": 4, "layout": {"dp_replicate": 1, "dp_shard": 2, "tp": 2, "pp": 1}}
    logger = metrics.MetricsLogger(config, config.run_dir, enabled=True, extra_info=info)
    logger.log(1, {"loss": 1.0})
    logger.close()
    assert captured["name"] == "x" and captured["group"] == "debug"
    assert captured["tags"] == ["recipe:debug", "model:llama3-debug", "layout:dp_shard2-tp2", "world:4", "sweep-1"]
    assert [p.name for p in (config.run_dir / "tensorboard").iterdir()] == ["debug-dp_shard2-tp2"]
    tracking = json.loads((config.run_dir / "tracking.json").read_text())
    assert tracking["wandb"]["id"] == captured["id"]

    # A requeued run continues the same wandb run; an explicit group wins over the recipe's name.
    config = dataclasses.replace(config, metrics=dataclasses.replace(config.metrics, wandb_group="lr-sweep"))
    metrics.MetricsLogger(config, config.run_dir, enabled=True, extra_info=info).close()
    assert captured["id"] == tracking["wandb"]["id"] and captured["group"] == "lr-sweep"


def test_wandb_auto_never_holds_up_a_run_whose_server_does_not_answer(tmp_path, monkeypatch, caplog):
    """Credentials, but a wandb server that takes connections and never answers (a firewall, a dead proxy):
    under "auto" the run goes on without wandb after the stated timeout, with one line. Asked for by name
    ("online"), wandb's error is the run's."""
    import socket

    import wandb

    from titan.observe import metrics

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)  # the kernel completes the connections; nobody reads or answers them
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
    monkeypatch.setattr(metrics, "WANDB_AUTO_TIMEOUT_S", 3)
    info = {"world_size": 1, "layout": {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 1}}
    args = ["--metrics.tensorboard", "false", "--metrics.wandb"]
    config = load_config(DEBUG_RECIPE, ["--job.output_dir", str(tmp_path / "auto"), *args, "auto"])
    try:
        with caplog.at_level("INFO", logger="titan"):
            metrics.MetricsLogger(config, config.run_dir, enabled=True, extra_info=info).close()
    finally:
        server.close()
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("wandb: off, its run")]
    assert "did not start within 3 s" in line and "training goes on without it" in line, line
    assert "wandb" not in json.loads((config.run_dir / "tracking.json").read_text())

    def unreachable(**kwargs):
        raise wandb.errors.CommError("Timed out initializing run")

    monkeypatch.setattr(wandb, "init", unreachable)
    config = load_config(DEBUG_RECIPE, ["--job.output_dir", str(tmp_path / "online"), *args, "online"])
    with pytest.raises(wandb.errors.CommError):
        metrics.MetricsLogger(config, config.run_dir, enabled=True, extra_info=info)


def test_wandb_auto_logs_online_with_credentials_and_is_off_without(tmp_path, monkeypatch, caplog):
    """A run nobody configured wandb for creates no wandb run; an API key or a `wandb login` (~/.netrc) turns it on."""
    import wandb

    from titan.observe import metrics

    started = []
    monkeypatch.setattr(
        wandb, "init", lambda **kwargs: started.append(kwargs["mode"]) or type("R", (), {"url": None})()
    )
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    config = load_config(DEBUG_RECIPE, ["--job.output_dir", str(tmp_path), "--metrics.tensorboard", "false"])
    with caplog.at_level("INFO", logger="titan"):
        info = {"world_size": 1, "layout": {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 1}}
        metrics.MetricsLogger(config, config.run_dir, enabled=True, extra_info=info).close()
    assert started == [] and "wandb" not in json.loads((config.run_dir / "tracking.json").read_text())
    assert "wandb: off" in caplog.text
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password 0123456789\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert metrics._wandb_credentials()
    monkeypatch.setenv("HOME", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("WANDB_API_KEY", "0123456789")
    assert metrics._wandb_credentials()


def test_a_mixture_of_experts_gets_an_expert_load_panel(runs, tmp_path):
    """The most and least loaded expert over the mean, in the worst layer of each logged step; a dense run has none."""
    overrides = tiny_overrides(tmp_path, **{"training.steps": "3", "training.local_batch_size": "2", "job.name": "moe"})
    result = run_titan("train", "--config", str(DEBUG_RECIPE.parent / "debug_moe.toml"), *overrides, timeout=300)
    assert result.returncode == 0, result.stderr
    moe = tmp_path / "moe"
    fig = figure([load_run(runs[0]), load_run(moe)])
    panel = next(ax for ax in fig.axes if ax.get_title().startswith("expert load"))
    logged = [m for m in metrics_of(moe) if "loss" in m]
    most, least = panel.lines  # the dense run drew nothing here
    worst = [max(v for k, v in m.items() if k.startswith("moe/load_max/")) for m in logged]
    assert most.get_label() == "moe" and list(most.get_ydata()) == worst and worst[0] > 1
    assert list(least.get_ydata()) == [min(v for k, v in m.items() if k.startswith("moe/load_min/")) for m in logged]
    assert least.get_linestyle() == ":" and list(most.get_xdata()) == [m["step"] for m in logged]
