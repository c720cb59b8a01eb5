#!/usr/bin/env bash
# The GPU check: on a GPU machine that reaches no network, run the GPU tests (`pytest -m gpu`) and the
# benchmark's chat and classify suites on the GPU, and leave every result under OUT. The parts run as separate
# calls, the tests first: on one H200 they took about 7 minutes (2026-12-04: FSDP's six runs under both
# launchers 126 s, the resumed run 62 s, the chat recipe 69 s), which with a machine's start and one rerun
# fills a session's 15 device minutes; the benchmarks (their steps' limits: 6.5 minutes; not yet run on a
# GPU) are for a session that has time left.
#
#   python bench/gpu_bundle.py build          # first, where pip works: .gpu/, what the GPU machine lacks
#   bash bench/gpu_check.sh OUT tests         # on the GPU machine, in a copy of the checkout with .gpu/
#   bash bench/gpu_check.sh OUT tests -k ...  # a rerun of some: what follows 'tests' goes to pytest
#   bash bench/gpu_check.sh OUT bench         # the same, the benchmarks
#   bash bench/gpu_check.sh OUT long          # the same, long rows: a random 1.1B Llama at 8k and 32k tokens
#                                             # against TRL, LoRA (tiled MLPs too) and full, bf16 (bench/long.py;
#                                             # 6-8 minutes)
#   bash bench/gpu_check.sh OUT --rehearse    # anywhere: the same install, chat model, test selection and
#                                             # result files, with the runs cut to a minimum (CPU, minutes)
#
# The machine's own torch, transformers, accelerate and peft are used; the packages it lacks come from the
# wheels in .gpu/ and the package itself from the checkout (PYTHONPATH, nothing installed system-wide). The
# chat model is SmolLM2-135M's architecture with random weights (bench/gpu_bundle.py says why), so chat figures
# are speed, memory and kernels, never quality.
#
# OUT gets: device.txt (nvidia-smi, torch, GPU name), a log per step, gpu-tests.xml, the benchmark's result
# files (sft-cuda.*, latest-cuda.*: copy them to bench/results/ to commit) and summary.txt with each step's
# exit status. Every step runs under its own time limit, so one that hangs cannot eat the others' minutes.
set -uo pipefail
part=${2:-}
case $part in tests|bench|long|--rehearse) ;; *) echo "usage: bash bench/gpu_check.sh OUT tests|bench|long|--rehearse" >&2
  exit 2;; esac
out=$1
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.." || exit 1
[ -d .gpu/wheels ] || { echo "error: no .gpu/ here; run python bench/gpu_bundle.py build first" >&2; exit 2; }

scratch=$(mktemp -d)
export PYTHONPATH="$scratch/site:$PWD/.gpu/site:$PWD" HF_HOME="$scratch/hf-home" HF_HUB_OFFLINE=1 \
  HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1

step() {  # step NAME SECONDS COMMAND...: run, log, and record the exit status
  local name=$1 seconds=$2
  shift 2
  timeout "$seconds" "$@" > "$out/$name.log" 2>&1
  echo "$name: exit $?" >> "$out/summary.txt"
}

: > "$out/summary.txt"
{ nvidia-smi || echo "no nvidia-smi"; python3 -c "import accelerate, peft, torch, transformers
print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name() if
torch.cuda.is_available() else '', 'transformers', transformers.__version__, 'accelerate', accelerate.__version__,
'peft', peft.__version__)"; } > "$out/device.txt" 2>&1

# flash-attn is not among the wheels (it compiles for far longer than the budget): packed batches run on
# SDPA, which the tests accept and name.
step install 60 python3 -m pip install --no-index --no-deps --no-compile --target "$scratch/site" \
  --python-version 3.12 --only-binary=:all: .gpu/wheels/*.whl
if [ "$part" = --rehearse ]; then  # what the GPU machine has and this one may lack: httpx (datasets needs it)
  step rehearse-install 120 python3 -m pip install --target "$scratch/rehearse-site" httpx
  export PYTHONPATH="$PYTHONPATH:$scratch/rehearse-site"
fi
step chat-model 120 python3 bench/gpu_bundle.py chat-model

if [ "$part" = --rehearse ]; then
  step gpu-tests 120 python3 -m pytest -m gpu --collect-only -q
  step bench-sft 600 python3 bench/run.py --suite sft --repeats 1 --train_examples 24 \
    --per_device_train_batch_size 4 --results_dir "$out"
  step bench-long 300 python3 bench/long.py --model_size tiny --lengths 256 --repeats 1 \
    --configs finetune finetune_tiled trl finetune_full trl_full --results_file "$out/long-rehearse.json"
elif [ "$part" = long ]; then  # 10 runs; each one's start-up is most of its time
  step bench-long 500 python3 bench/long.py --model_size 1b --lengths 8192 32768 --repeats 1 \
    --configs finetune finetune_tiled trl finetune_full trl_full --results_file "$out/long-cuda.json"
elif [ "$part" = tests ]; then  # every test, not -x: a call is too dear to learn one failure a call
  step gpu-tests 480 python3 -m pytest -m gpu -v -rfE --durations=0 --junitxml="$out/gpu-tests.xml" "${@:3}"
else
  # One repeat each (a configuration's start-up is most of its time on a GPU), the shorter suite first. The
  # chat suite at a batch that keeps the GPU busy: 512 conversations of about 60 tokens a step, 32 steps.
  step bench-classify 150 python3 bench/run.py --suite classify --repeats 1 --results_dir "$out"
  step bench-sft 240 python3 bench/run.py --suite sft --repeats 1 --train_examples 16384 \
    --per_device_train_batch_size 512 --results_dir "$out"
fi
rm -rf "$scratch"
cat "$out/summary.txt"
