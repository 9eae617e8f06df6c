#!/usr/bin/env bash
# Everything dsfunc measures on the GPU machine, in one go: GPU tests, then the benchmarks.
#   bash bench/run_gpu.sh [OUTDIR] [PART]     PART: tests | engine | zero13 | zero67 | all (default)
# Needs optree (pip install, or the wheels in .whl/). Logs go to OUTDIR (default ./gpu-logs).
set -uo pipefail
out=${1:-gpu-logs}
part=${2:-all}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$HOME/.cache/dsfunc-extensions}
if [ -d .whl ] && ! python3 -c "import optree" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpus.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$out/gpus.txt"
ngpu=$(nvidia-smi -L | wc -l)

if [ "$part" = tests ] || [ "$part" = all ]; then
    for t in tests/kernels/test_kernels_cuda.py tests/zero/test_zero_cuda.py "tests/optim tests/test_scaling.py" \
             tests/test_step.py; do  # one process each: CUDA settings a test changes stay with it
        timeout 150 python3 -m pytest -q -p no:cacheprovider $t 2>&1 | tail -40
    done | tee "$out/tests.txt"
    timeout 60 python3 bench/bench_step_overhead.py --device cuda --steps 100 2>&1 | tee "$out/overhead.txt"
fi
if [ "$part" = engine ] || [ "$part" = all ]; then  # checkpoints and the engine on NCCL ranks
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/checkpoint/test_distributed.py -k cuda 2>&1 | tail -30 \
        | tee "$out/checkpoint-cuda.txt"
    timeout 300 bash tests/deepspeed/scripts/gpu_run.sh "$ngpu" 2>&1 | tail -40 | tee "$out/engine-cuda.txt"
fi
run_zero() {  # model systems
    timeout 150 python3 -m torch.distributed.run --nproc_per_node "$ngpu" bench/bench_zero.py \
        --model "$1" --systems "$2" 2>&1 | grep -vE "^W1|^\s*$|OMP_NUM_THREADS|\*\*\*\*" | tee "$out/zero-$1.txt"
}
if [ "$part" = zero13 ] || [ "$part" = all ]; then run_zero 1.3b dsfunc:2,dsfunc:3,fsdp2; fi
if [ "$part" = zero67 ] || [ "$part" = all ]; then run_zero 6.7b dsfunc:3,fsdp2; fi
