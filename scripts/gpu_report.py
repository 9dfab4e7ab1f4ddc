"""The table of scripts/gpu_check.sh: its stages' results and the benchmark, dated, with the commit and the device,
as Markdown (printed, and <out>/gpu_check.md: what goes into the benchmarks docs) and JSON (<out>/gpu_check.json).

    python scripts/gpu_report.py OUT --date 2026-07-20 --commit abc1234
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

STAGES = {"smoke": "pytest -m smoke (CPU tests on this torch)", "cuda": "pytest -m cuda",
          "bench": "scripts/bench.py --gpu"}  # fmt: skip


def stage_results(out: Path) -> dict:
    """Each stage that ran: its exit status and the last line of its log (pytest's summary)."""
    results = {}
    for name in STAGES:
        status = out / f"{name}.status"
        if status.exists():
            lines = (out / f"{name}.log").read_text().strip().splitlines() or [""]
            results[name] = {"status": int(status.read_text()), "summary": lines[-1].strip("= ")}
    return results


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"CPU ({platform.processor() or platform.machine()}, dry run)"


def markdown(report: dict) -> str:
    lines = [
        f"### gpu_check: {report['date']}, commit {report['commit']}, {report['device']}, torch {report['torch']}",
        "",
        "| stage | status | result |",
        "| --- | --- | --- |",
    ]
    for name, stage in report["stages"].items():
        verdict = "ok" if stage["status"] == 0 else f"failed ({stage['status']})"
        lines.append(f"| {STAGES[name]} | {verdict} | {stage['summary']} |")
    bench = report.get("bench")
    if bench:
        lines += [
            "",
            f"{bench['layers']} layers of Llama 3 8B's shape (here dim {bench['dim']}) at seq {bench['seq_len']}, "
            "bf16, one device; "
            f"median of {bench['steps'] - bench['warmup']} steps after {bench['warmup']}.",
            "",
            "| run | tokens/s | MFU | step ms | peak GiB, measured | peak GiB, titan plan | plan - measured |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in bench["results"]:
            planned = "-" if r["planned_peak_gib"] is None else f"{r['planned_peak_gib']:.2f}"
            error = "-" if r["plan_vs_measured"] is None else f"{r['plan_vs_measured']:+.1%}"
            lines.append(
                f"| {r['run']} | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | {r['step_time_ms']:.1f} | "
                f"{r['peak_memory_gib']:.2f} | {planned} | {error} |"
            )
        lines += ["", *(f"- [{'x' if met else ' '}] {goal}" for goal, met in bench["goals"].items())]
        if bench["dry_run"]:
            lines.append("- dry run: on the CPU the measured peak is the process's resident memory, not tensors")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--date", required=True)
    parser.add_argument("--commit", required=True)
    args = parser.parse_args()
    bench_file = args.out / "bench.json"
    report = {
        "date": args.date,
        "commit": args.commit,
        "device": device_name(),
        "torch": torch.__version__,
        "stages": stage_results(args.out),
        "bench": json.loads(bench_file.read_text()) if bench_file.exists() else None,
    }
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    (args.out / "gpu_check.md").write_text(table)
    print(table, end="")


if __name__ == "__main__":
    main()
