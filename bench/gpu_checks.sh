#!/usr/bin/env bash
# The checks for a GPU host (one GPU, torch already installed, no network), in one go:
# the GPU tests, the GPU overhead bench, then the CPU benches on that machine's quieter cores.
# Each step is bounded so a hang in one still leaves the others' figures. Results go to $OUT
# (or ./gpu-checks): machine.txt, the JSON figures, and steps.tar (one NAME.txt a step). Wheels
# missing there travel in .whl/ (ignored by git; for its Python 3.12, pip download --no-deps
# --only-binary=:all: --python-version 3.12 --platform manylinux...): msgspec, textual,
# platformdirs, mdit-py-plugins, linkify-it-py, uc-micro-py, pytest-asyncio, and pytest, pluggy,
# iniconfig (pytest-asyncio 1.5 needs pytest 8.4 or later: carried with it), 1.6 MB in all.
#
#   bash bench/gpu_checks.sh            # all of it
#   bash bench/gpu_checks.sh gpu        # the GPU tests, real jobs and benches only
#   bash bench/gpu_checks.sh attrib     # those, and the transformer overhead's attribution
#   bash bench/gpu_checks.sh floor      # the GPU tests, real jobs, and the attribution with the comm hook's floor
#   bash bench/gpu_checks.sh cpu        # the CPU benches only (with the short model's split by thread)
#   bash bench/gpu_checks.sh goals      # the overhead goals on CPU and the short model's attribution on these cores,
#                                        # then the GPU tests, real jobs and the transformer's overhead,
#                                        # each step cut to what is left of $DEADLINE seconds (default 540)
set -u
out=${OUT:-gpu-checks}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
# Each step's output is appended to $out/steps.tar as NAME.txt once the step ends, so that the
# results are a few files however many steps ran (a killed step's output stays a file of its own).
start=$SECONDS
deadline=${DEADLINE:-100000}
step() {  # step NAME SECONDS COMMAND...: run it, bounded, its output to the screen and $out/NAME.txt
  local name=$1 limit=$2
  shift 2
  local left=$((deadline - (SECONDS - start)))
  if [ "$left" -lt 20 ]; then echo "== $name: skipped, ${left}s left"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name ($(date +%T), at most ${limit}s): $*"
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.txt"
  echo "== $name: exit ${PIPESTATUS[0]}"
  tar rf "$out/steps.tar" -C "$out" "$name.txt" && rm -f "$out/$name.txt"
}
{ nvidia-smi -L; nproc; ls /dev | grep -E '^(nvidia|kfd)' | tr '\n' ' '; echo
  python3 -c "from ddpdoctor import native_cache; print('gpu_visible', native_cache.gpu_visible())"; python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(0), 'nccl', torch.cuda.nccl.version())"; } 2>&1 | tee "$out/machine.txt"
mode=${1:-all}
if [ "$mode" = goals ]; then  # the figures that decide the overhead goals first, within one deadline
  [ -z "${DEADLINE:-}" ] && deadline=540
  step native_build 100 python3 -m ddpdoctor.runtime.native
  step hot_path 60 python3 bench/hot_path.py --steps 2000
  step interleaved_short 130 python3 bench/interleaved.py --model short --rounds 3000 --json "$out/interleaved_short.json"
  # the same with the models built the other way round: where each model's tensors land moves a
  # plain step by about 1% on the VM, the same way for the same order (2026-12-04)
  step interleaved_short_reverse 130 python3 bench/interleaved.py --model short --rounds 3000 --build-order reverse
  # where the training thread's +95 µs a step went there (2026-12-04; its own accounting 38): the
  # attribution rows (python-lines: what cold Python lines cost), step by step and in blocks of 25
  step interleaved_attrib 150 python3 bench/interleaved.py --model short --rounds 2000 --attribution
  step interleaved_attrib_block 150 python3 bench/interleaved.py --model short --rounds 80 --block 25 --attribution
  step pytest_gpu 120 python3 -m pytest -v -s -m gpu -p no:cacheprovider -o asyncio_mode=strict --timeout 100 tests/test_cuda.py \
    tests/test_replica_comparison.py
  step real_jobs 150 python3 bench/real_jobs.py --parallel 8
  step gpu_overhead 120 python3 bench/gpu_overhead.py --model transformer --pairs 5
  echo "== done in $((SECONDS - start)) s"
  exit 0
fi
if [ "$mode" != cpu ]; then
  # (the 3-rank scaling test builds the native extension first: about 40 s on 16 cores)
  step pytest_gpu 300 python3 -m pytest -v -s -m gpu -p no:cacheprovider -o asyncio_mode=strict --timeout 200 tests/test_cuda.py \
    tests/test_replica_comparison.py
  # real jobs under `ddpdoctor run`, each beside the same job plain: bit-identical losses, CUDA timing
  step real_jobs 160 python3 bench/real_jobs.py --parallel 8
  if [ "$mode" = floor ]; then  # the attribution with the comm hook's floor rows and a profile of every thread
    # (the profiler's post-processing of 9 transformers ran past 200 s: 2 steps each, after yappi)
    step gpu_attrib_floor 240 python3 bench/gpu_attrib.py --model transformer --pairs 7 --warmup 30 --floor --threads \
      --yappi 20 --profile-steps 2
    step gpu_attrib_small 100 python3 bench/gpu_attrib.py --model small --pairs 7 --warmup 30 --only plain-2 pyhook ddpdoctor
    exit 0
  fi
  lt=$(mktemp -d)
  step lightning_gpu_plain 90 python3 examples/zero_code/lightning_train.py --accelerator gpu --devices 1 --steps 12
  step lightning_gpu 90 python3 -m ddpdoctor run --run-dir "$lt/run" -- python3 examples/zero_code/lightning_train.py \
    --accelerator gpu --devices 1 --steps 12
  step lightning_report 60 python3 -m ddpdoctor report "$lt/run"
  step gpu_overhead 150 python3 bench/gpu_overhead.py --pairs 7 --json "$out/gpu_overhead.json"
  step hot_path_cuda 90 python3 bench/hot_path.py --device cuda --steps 1000 --pairs 6 --block 100
  if [ "$mode" = attrib ]; then  # what the transformer's overhead is made of: hook floor, events, marks
    step gpu_attrib 150 python3 bench/gpu_attrib.py --model transformer --pairs 5 --warmup 30 --events
  fi
  if [ -d .base/bench ]; then  # an earlier tree, carried: its figures beside these, on the same machine
    (cd .base && step gpu_overhead_base 120 python3 bench/gpu_overhead.py --pairs 7)
  fi
fi
[ "$mode" != all ] && exit 0
step hot_path 120 python3 bench/hot_path.py --steps 2000
step overhead 150 python3 bench/overhead.py --pairs 7 --no-profiler --no-debug-env
# the short model's overhead split by thread and route (CPU columns), on quieter cores than the VM's
step overhead_short_split 240 python3 bench/overhead.py --model short --routes --attribution --pairs 9 \
  --no-profiler --no-debug-env --json "$out/overhead_short_split.json"
