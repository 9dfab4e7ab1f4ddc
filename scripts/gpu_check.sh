#!/usr/bin/env bash
# One command that proves titan's GPU paths on the torch the machine has, and measures them (under 10 minutes on
# one H100):
#   1. titan into this Python without network: the packages it lacks from a folder of wheels (--wheels DIR);
#   2. pytest -m smoke (one process, FSDP2 and TP2 on gloo, resume) on this torch, then pytest -m cuda;
#   3. scripts/bench.py --gpu: 8B-shaped layers at seq 8,192, eager and compiled, each checkpointing mode, Float8,
#      next to titan plan's peak;
#   4. one dated table with the commit and the device: <out>/gpu_check.md and <out>/gpu_check.json.
#
#   scripts/gpu_check.sh [--wheels DIR] [--out DIR] [--layers N]
#   scripts/gpu_check.sh --dry-run [--skip-tests] [--runs eager,...]   # on the CPU, as far as a CPU goes (CI)
#   scripts/gpu_check.sh --fetch-wheels DIR   # on a machine with network: the wheels a bare CUDA image lacks
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
dry_run=0 skip_tests=0 wheels="" out="" layers=4 runs="" fetch=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) dry_run=1 ;;
        --skip-tests) skip_tests=1 ;;
        --wheels) wheels=$2; shift ;;
        --out) out=$2; shift ;;
        --layers) layers=$2; shift ;;
        --runs) runs=$2; shift ;;
        --fetch-wheels) fetch=$2; shift ;;
        -h | --help) sed -n '2,14p' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

# What titan imports at its core, as (module distribution) pairs, plus pytest for the checks and torchao for Float8.
needed="typer:typer numpy:numpy tqdm:tqdm filelock:filelock huggingface_hub:huggingface-hub tokenizers:tokenizers
safetensors:safetensors tomli_w:tomli-w pytest:pytest torchao:torchao"

if [ -n "$fetch" ]; then  # for a CUDA image of Python 3.12 on x86-64; run where the package index is reachable
    # shellcheck disable=SC2046
    "$python" -m pip download --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any -d "$fetch" \
        $(for pair in $needed; do printf '%s ' "${pair#*:}"; done | sed 's/torchao/torchao>=0.18,<0.19/')
    exit 0
fi

date=$(date -u +%Y-%m-%d)
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
out=${out:-outputs/gpu_check/$date-$commit}
mkdir -p "$out"
echo "gpu_check: $date, commit $commit, results in $out"

missing() {  # the distributions whose module this Python cannot import
    for pair in $needed; do
        "$python" -c "import ${pair%%:*}" 2> /dev/null || printf '%s ' "${pair#*:}"
    done
}

# 1. Install: never from the network, and never over the image's torch.
lacking=$(missing)
if [ -n "$lacking" ] && [ -n "$wheels" ]; then
    # shellcheck disable=SC2086  # one distribution per word
    "$python" -m pip install -q --no-index --find-links "$wheels" $lacking
    lacking=$(missing)
fi
required=$(printf '%s' "$lacking" | sed 's/torchao//' | xargs)
if [ -n "$required" ]; then
    echo "gpu_check: this Python lacks $required; pass --wheels DIR (scripts/gpu_check.sh --fetch-wheels DIR)" >&2
    exit 2
fi
case " $lacking " in
    *" torchao "*) echo "gpu_check: torchao missing: the Float8 test and run are skipped (pass --wheels DIR)" ;;
esac
if [ "$dry_run" = 1 ]; then
    echo "gpu_check: install skipped (dry run: this environment's titan is used as it is)"
elif "$python" -m pip install -q --no-index --no-deps --no-build-isolation -e . > "$out/install.log" 2>&1; then
    echo "gpu_check: titan installed (editable, no dependencies touched)"
else  # no setuptools in the image: run from this checkout
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    echo "gpu_check: titan not installable here (see $out/install.log); running from $PWD"
fi

# 2. Tests: the smoke subset on this torch, then the CUDA tests (each skips cleanly on the CPU).
stage() {  # name, seconds, command...: run it, keep its log and status
    local name=$1 seconds=$2
    shift 2
    echo "gpu_check: $name"
    set +e
    timeout "$seconds" "$@" > "$out/$name.log" 2>&1
    echo $? > "$out/$name.status"
    set -e
    tail -n 1 "$out/$name.log"
}
if [ "$skip_tests" = 0 ]; then
    # The CPU tests, on the CPU: with the GPU visible, training.device = "auto" would put them on it.
    stage smoke 300 env CUDA_VISIBLE_DEVICES= "$python" -m pytest -m smoke -q -p no:cacheprovider
    stage cuda 300 "$python" -m pytest -m cuda -q -p no:cacheprovider -rs
fi

# 3. Benchmarks (the Float8 run only where torchao is).
bench_runs=${runs:-eager,eager_selective_ac,eager_full_ac,compiled,float8_compiled}
case " $lacking " in *" torchao "*) bench_runs=${bench_runs//,float8_compiled/} ;; esac
bench=("$python" scripts/bench.py --gpu --layers "$layers" --runs "$bench_runs" --json "$out/bench.json"
    --history "$out/history.jsonl")
if [ "$dry_run" = 1 ]; then
    bench+=(--dry-run --steps 3 --warmup 1)
else
    bench+=(--steps 20 --warmup 5)
fi
stage bench 420 "${bench[@]}"

# 4. The table.
"$python" scripts/gpu_report.py "$out" --date "$date" --commit "$commit"
