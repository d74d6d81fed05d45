#!/usr/bin/env bash
# The checks for a lent GPU machine (one GPU, torch already installed, no network), in one go:
# the GPU tests, the GPU overhead bench, then the CPU benches on that machine's quieter cores.
# Each step is bounded so a hang in one still leaves the others' figures. Results go to $OUT
# (or ./gpu-session), one file per step. Wheels missing there (msgspec) travel in .whl/.
#
#   bash bench/gpu_session.sh            # all of it
#   bash bench/gpu_session.sh gpu        # the GPU tests and bench only
#   bash bench/gpu_session.sh cpu        # the CPU benches only (with the short model's split by thread)
set -u
out=${OUT:-gpu-session}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
step() {  # step NAME SECONDS COMMAND...: run it, bounded, its output to the screen and $out/NAME.txt
  local name=$1 limit=$2
  shift 2
  echo "== $name ($(date +%T), at most ${limit}s): $*"
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.txt"
  echo "== $name: exit ${PIPESTATUS[0]}"
}
{ nvidia-smi -L; nproc; python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(0), 'nccl', torch.cuda.nccl.version())"; } 2>&1 | tee "$out/machine.txt"
mode=${1:-all}
if [ "$mode" != cpu ]; then
  step pytest_gpu 170 python3 -m pytest -v -s -m gpu -p no:cacheprovider -o asyncio_mode=strict --timeout 140 tests/test_cuda.py
  step hot_path_cuda 90 python3 bench/hot_path.py --device cuda --steps 1000 --pairs 6 --block 100
  step gpu_overhead 120 python3 bench/gpu_overhead.py --pairs 7 --json "$out/gpu_overhead.json"
  # what the transformer's overhead is made of: the comm hook's floor, timing events, full marks
  step gpu_attrib 150 python3 bench/gpu_attrib.py --model transformer --pairs 5 --warmup 30 --events
  if [ -d .base/bench ]; then  # an earlier tree, carried: its figures beside these, on the same machine
    (cd .base && step gpu_overhead_base 120 python3 bench/gpu_overhead.py --pairs 7)
  fi
fi
[ "$mode" = gpu ] && exit 0
step hot_path 120 python3 bench/hot_path.py --steps 2000
step overhead 150 python3 bench/overhead.py --pairs 7 --no-profiler --no-debug-env
# the short model's overhead split by thread and route (CPU columns), on quieter cores than the VM's
step overhead_short_split 240 python3 bench/overhead.py --model short --routes --attribution --pairs 9 \
  --no-profiler --no-debug-env --json "$out/overhead_short_split.json"
