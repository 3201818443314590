#!/usr/bin/env bash
# Build and check megalite on a CUDA machine, in one go: install against the machine's torch, build the
# extension for its GPU, run the GPU kernel tests and the whole suite, and the GPU benchmarks.
#
#   bash tools/gpu_check.sh LOGDIR [STEP ...]     STEP: build kernels gputests features bench bench32 mfu titan
#                                                 infer suite mcore mcore-only
#                                                 (default: all but bench32, mcore and mcore-only)
# MFU_MICRO_BATCHES (default "8 16") sets the mfu step's micro-batch sizes. torchtitan (the titan step's peer)
# and anything else the machine lacks come as wheels in .whl/, as the device notes say.
#
# Each step writes LOGDIR/<step>.log and runs under its own time limit, so one failing or slow step
# still leaves the others' results; a summary line per step is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
logs=${1:?usage: tools/gpu_check.sh LOGDIR [STEP ...]}
shift
steps=${*:-build kernels gputests features bench mfu titan infer suite}
# Megatron-Core (and anything else the machine lacks) may come as wheels in .whl/, as the device notes say.
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
mkdir -p "$logs"
export PYTHONUNBUFFERED=1
summary=()

step() {  # step NAME LIMIT_S COMMAND...
    local name=$1 limit=$2
    shift 2
    [[ " $steps " == *" $name "* ]] || return 0
    local start=$SECONDS
    echo "=== $name ($(date -u +%H:%M:%S))"
    timeout --kill-after=10 "$limit" bash -c "$*" >"$logs/$name.log" 2>&1
    local code=$?
    summary+=("$name: exit $code in $((SECONDS - start)) s")
    tail -n 25 "$logs/$name.log"
}

{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
    python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
    nvcc --version | tail -n 2
} >"$logs/env.log" 2>&1
cat "$logs/env.log"

# CXX: the image's other g++ builds (/opt/gcc, which the image may also name in $CXX) gave an extension whose
# failed checks crashed instead of raising (see csrc/build.py); the system g++ matches torch's runtime.
step build 200 "MEGALITE_NO_EXT=1 python3 -m pip install -q --no-deps --no-build-isolation --use-pep517 -e . &&
    CXX=/usr/bin/g++ TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 python3 setup.py build_ext --inplace &&
    python3 -m megalite.kernels && cp megalite/_C*.so \"$logs/\""
step kernels 90 "python3 -m pytest -q -n 12 -rf tests/kernels"
step gputests 200 "python3 -m pytest -q -n 2 -rf tests/rlhf/test_placement.py::test_offload_on_one_gpu tests/training/test_gpu.py \
    tests/inference/test_cuda_graphs.py"
step features 120 "python3 -m pytest -q -rfs -s tests/test_gpu_features.py"
step bench 200 "python3 benchmarks/kernels.py --dtype bfloat16 && cp benchmarks/results/gpu_kernels_bfloat16.json \"$logs/\""
step bench32 120 "python3 benchmarks/kernels.py --dtype float32 --no-compile &&
    cp benchmarks/results/gpu_kernels_float32.json \"$logs/\""
step mfu 240 "python3 benchmarks/gpu_gpt.py --megalite-only --profile --micro-batch-size ${MFU_MICRO_BATCHES:-8 16} \
    --json \"$logs/gpu_gpt_mfu.json\""
step titan 300 "python3 benchmarks/gpu_gpt.py --torchtitan --micro-batch-size 8 --json \"$logs/gpu_gpt_torchtitan.json\""
step infer 120 "python3 benchmarks/gpu_inference.py --requests 128 --batches 64,128"
step mcore-only 150 "python3 benchmarks/megatron_core_gpt.py --micro-batch-size 8 --global-batch-size 32"
step mcore 200 "python3 benchmarks/gpu_gpt.py --micro-batch-size 8"
step suite 240 "OMP_NUM_THREADS=1 python3 -m pytest -q -n 12 -p no:cacheprovider --durations=15 tests"

printf '%s\n' "${summary[@]}"
