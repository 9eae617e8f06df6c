#!/usr/bin/env bash
# Everything dsfunc measures on the GPU machine: GPU tests, then the benchmarks, one log file per part.
#   bash bench/run_gpu.sh [OUTDIR] [PARTS]     PARTS: comma-separated, of
#     tests      the CUDA tests (kernels, steps, CUDA graphs, activation memory, offload)
#     overhead   bench_step_overhead: the per-step cost of train_step against a plain loop (tiny MLP, small GPT)
#     engine     the engine on NCCL ranks: engine vs functional, an exact resume, DeepSpeed's CIFAR-10 tutorial
#     single13   bench_single at 1.3b: plain / compiled (loss inside) PyTorch against dsfunc's variants
#     single124  bench_single at 124m
#     ce         bench_cross_entropy: the output projection and loss alone, eager / compiled / dsfunc's op
#     offload    the capped 24 GiB GPU: the largest GPT without and with offload, and DeepSpeed ZeRO-Offload
#     offload6   issue 28's shape on the capped GPU: 6.3B, micro-batch 4 x accumulation 8, 4 micro-batches a backward,
#                dsfunc then DeepSpeed ZeRO-Offload, with a profiled step (OFFLOAD6_TRIALS, OFFLOAD_SUMS: elements of
#                sums kept on the device, OFFLOAD_AHEAD: +spec's elements, OFFLOAD_CLIP, OFFLOAD_PROFILE= to time
#                without the profiler, OFFLOAD_STACKS=1: every thread's stack sampled each 0.5 s of the timed steps into
#                OUTDIR/stacks-SIZE-SETTING-SYSTEM.txt, "+" as "_")
#     zero13     bench_zero at 1.3b on every GPU: dsfunc ZeRO-2/3 against FSDP2 and DeepSpeed
#     why124     dsfunc+compile at 124m again, with dynamo's recompile and graph-break logs
#     profile124 the top ops (host and device) of plain+compile, dsfunc and dsfunc+compile at 124m
#     graphs     tests/test_graphs_cuda.py, and the activation-memory test with its figures printed
#     ckpt13     issue 17's checkpointing table at 1.3b: plain and dsfunc, ZeRO-0 and ZeRO-3, each policy
#     hostadam   the host Adam of ZeRO-Offload against torch's fused CPU Adam, bf16 and fp16, on 15 threads
#     fit13      the largest micro-batch the checkpointed systems train at 1.3b (bench_fit's bisection)
#     adam       bench_fused_adam: the CUDA kernels against torch and the bandwidth floor, 1.3b elements
#     long       the longest sequence that trains at LONG_MODEL (1.3b): ZeRO-3, the MLP untiled and tiled
#     longhf     the longest sequence at HF Llama shapes, HF + DeepSpeed ZeRO-3 offload against dsfunc (bf16 states at 8B),
#                one step a probe: LONGHF_MODEL (llama-8b), LONGHF_DS_SEQS (32768,65536), LONGHF_SEQS (131072)
#   default: tests,overhead,engine,single13,single124
# Needs optree (pip install, or the wheels in .whl/, which also hold DeepSpeed for the comparisons).
set -uo pipefail
out=${1:-gpu-logs}
parts=",${2:-tests,overhead,engine,single13,single124},"
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# DeepSpeed's op builder cannot parse torch's "9.0a" arch entries; its ops build for plain sm_90
export DS_ARCH_LIST=${DS_ARCH_LIST:-9.0}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$HOME/.cache/dsfunc-extensions}
if [ -d .whl ] && ! python3 -c "import optree" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
want() { [[ $parts == *",$1,"* ]]; }
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; python3 -c "import torch; print('torch', torch.__version__)"; 
  date -u; } | tee "$out/machine.txt"
ngpu=$(nvidia-smi -L | wc -l)

if want tests; then
    for t in tests/kernels/test_cross_entropy_cuda.py tests/kernels/test_cross_entropy.py \
             tests/kernels/test_kernels_cuda.py tests/kernels/test_kernels.py "tests/optim tests/test_scaling.py" \
             tests/test_step.py tests/zero/test_zero_cuda.py tests/test_graphs_cuda.py tests/test_remat_cuda.py \
             tests/zero/test_offload_cuda.py tests/zero/test_backward_by_units.py "tests/kernels/test_step_scalars_cuda.py \
             tests/kernels/test_step_scalars.py tests/test_step_ops.py"; do  # one process each: CUDA settings a test changes stay with it
        [ -e "${t%% *}" ] || continue
        echo "== $t"
        timeout 200 python3 -m pytest -q -p no:cacheprovider -rs $t 2>&1 | tail -25
    done 2>&1 | tee "$out/tests.txt"
fi
if want overhead; then
    timeout 120 python3 bench/bench_step_overhead.py --device cuda --steps 200 2>&1 | tee "$out/overhead.txt"
fi
if want engine; then  # the engine on NCCL ranks, DeepSpeed's CIFAR-10 tutorial as written
    timeout 300 bash tests/deepspeed/scripts/gpu_run.sh "$ngpu" 2>&1 | tail -40 | tee "$out/engine.txt"
fi
single() {  # model systems timeout [log name]
    timeout "$3" python3 bench/bench_single.py --model "$1" --systems "$2" --warmup 5 --steps 15 2>&1 \
        | grep -vE "^\s*$|UserWarning|warnings.warn" | tail -40 | tee "$out/${4:-single-$1}.txt"
}
if want single13; then
    single 1.3b ${SINGLE13:-plain+compile,plain+compile+fused,dsfunc,dsfunc+fused,dsfunc+compile+fused,dsfunc+compile+graph+fused} ${SINGLE13_S:-330}
fi
if want single124; then
    single 124m ${SINGLE124:-plain,plain+compile,plain+compile+fused,dsfunc,dsfunc+fused,dsfunc+compile+fused,dsfunc+compile+graph,dsfunc+compile+graph+fused} 240
fi
if want ce; then
    timeout 120 python3 bench/bench_cross_entropy.py 2>&1 | grep -vE "UserWarning|warnings.warn" | tee "$out/ce.txt"
fi
if want graphs; then
    { timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_graphs_cuda.py 2>&1 | tail -15
      timeout 150 python3 -m pytest -q -s -p no:cacheprovider tests/test_remat_cuda.py 2>&1 | tail -5; } \
        | tee "$out/graphs.txt"
fi
if want ckpt13; then
    single 1.3b plain,plain+ckpt,dsfunc,dsfunc+units,dsfunc+selective,dsfunc+zero3,dsfunc+zero3+units 330 ckpt-1.3b
fi
if want hostadam; then
    timeout 200 python3 bench/bench_host_adam.py --threads 15 --dtypes bfloat16,float16 2>&1 | tee "$out/host-adam.txt"
fi
if want fit13; then
    timeout 500 python3 bench/bench_fit.py --model 1.3b --systems dsfunc+units,plain+ckpt 2>&1 \
        | grep -vE "^\s*$|UserWarning|warnings.warn" | tee "$out/fit13.txt"
fi
if want adam; then
    timeout 200 python3 bench/bench_fused_adam.py 2>&1 | tee "$out/fused-adam.txt"
fi
if want long; then
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_tiled.py 2>&1 | tail -5 | tee "$out/tiled-tests.txt"
    timeout "${LONG_S:-420}" python3 bench/bench_long_sequence.py --model "${LONG_MODEL:-1.3b}" \
        --systems "${LONG_SYSTEMS:-dsfunc+zero3+units+cpu+fused,dsfunc+zero3+units+cpu+fused+tiled}" \
        --start "${LONG_START:-32768}" --granularity "${LONG_GRAN:-32768}" 2>&1 \
        | grep -vE "^\s*$|UserWarning|warnings.warn" | tee "$out/long.txt"
fi
if want longhf; then  # kernels built first: a probe stopped mid-build would leave a lock that hangs the next
    { python3 -c "from dsfunc.kernels.native import native_ready as r; print('dsfunc kernels', r('cpu'), r('cuda'))"
      TORCH_CUDA_ARCH_LIST=$DS_ARCH_LIST python3 -c "from deepspeed.ops.op_builder import CPUAdamBuilder as b; b().load()"
      m=${LONGHF_MODEL:-llama-8b}; bf=$([ "$m" = llama-8b ] && echo +bf16)
      for run in "hf+deepspeed$bf ${LONGHF_DS_SEQS:-32768,65536} 120" "hf+dsfunc$bf ${LONGHF_SEQS:-131072} 310"; do
          set -- $run
          timeout $(($3 + 20)) python3 bench/bench_long_sequence.py --model "$m" --systems "$1" --seqs "$2" --limit "$3"
      done; } 2>&1 | grep -vE "^\s*$|UserWarning|warnings.warn" | tee "$out/longhf.txt"
fi
if want profile124; then
    timeout 200 python3 bench/bench_single.py --model 124m --systems plain+compile,dsfunc,dsfunc+compile \
        --warmup 5 --steps 5 --profile 2>&1 | grep -vE "UserWarning|warnings.warn|USDT" > "$out/profile124.txt"
fi
if want why124; then
    TORCH_LOGS=recompiles,graph_breaks timeout 150 python3 bench/bench_single.py --model 124m \
        --systems dsfunc,dsfunc+compile --warmup 5 --steps 30 2>&1 | grep -vE "^\s*$|UserWarning|warnings.warn" \
        | tail -30 | tee "$out/why124.txt"
fi
if want offload; then  # the GPU offload tests first, then the capped GPU
    OFFLOAD_DEFAULT="none:24x2048/32x2560,opt:32x3200/40x3584,opt+param:40x3584/32x4096,deepspeed:32x2560"
    OFFLOAD_DEFAULT+=",deepspeed-opt+param:40x3584"
    timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/zero/test_offload_cuda.py 2>&1 \
        | tee "$out/offload-tests.txt" | tail -15
    TORCH_CUDA_ARCH_LIST=$DS_ARCH_LIST timeout "${OFFLOAD_S:-400}" python3 bench/bench_offload.py --cap_gib 24 \
        --trials "${OFFLOAD_TRIALS:-$OFFLOAD_DEFAULT}" --micro "${OFFLOAD_MICRO:-4}" \
        --trial_timeout "${OFFLOAD_TRIAL_S:-150}" 2>&1 | grep -vE "^\s*$|UserWarning|warnings.warn" | tee "$out/offload.txt"
fi
if want offload6; then
    TORCH_CUDA_ARCH_LIST=$DS_ARCH_LIST timeout "${OFFLOAD_S:-560}" python3 bench/bench_offload.py --cap_gib 24 --micro 4 \
        --accum 8 --steps 2 --trials "${OFFLOAD6_TRIALS:-deepspeed:40x3584}" --backward_group "${OFFLOAD_GROUP:-4}" \
        --device_sums "${OFFLOAD_SUMS:-0}" --ahead "${OFFLOAD_AHEAD:-0}" --clip "${OFFLOAD_CLIP:-1.0}" \
        ${OFFLOAD_PROFILE---profile} --stacks "${OFFLOAD_STACKS:+$out}" \
        --trial_timeout "${OFFLOAD_TRIAL_S:-290}" 2>&1 | grep -vE "^\s*$|UserWarning|warnings.warn" | tee "$out/offload6.txt"
fi
if want zero13; then
    TORCH_CUDA_ARCH_LIST=$DS_ARCH_LIST timeout 300 python3 -m torch.distributed.run --nproc_per_node "$ngpu" \
        bench/bench_zero.py \
        --model 1.3b --systems dsfunc:2,dsfunc:3,dsfunc:3+compile,fsdp2,fsdp2c,deepspeed:2,deepspeed:3 \
        > "$out/zero-1.3b.txt" 2>&1
    grep -E "^\|" "$out/zero-1.3b.txt"
fi
