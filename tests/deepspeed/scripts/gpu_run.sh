#!/usr/bin/env bash
# The engine on CUDA ranks (NCCL), for the GPU machine: engine vs functional API, an exact resume of a
# DeepSpeed-API script at ZeRO-3 in bf16, and DeepSpeed's CIFAR-10 tutorial (evaluating the original net).
#   bash tests/deepspeed/scripts/gpu_run.sh [NGPU]
set -uo pipefail
n=${1:-2}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:${PYTHONPATH:-}
run() { timeout 200 python3 -m torch.distributed.run --nproc_per_node "$n" "$@" 2>&1 | grep -vE "^W1|OMP_NUM|\*{8}"; }
tmp=$(mktemp -d)
echo "== engine vs functional"; run tests/deepspeed/scripts/gpu_check.py || echo "gpu_check FAILED"
cat > "$tmp/ds.json" <<JSON
{"train_batch_size": $((4 * n)), "train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": true},
 "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}},
 "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, "steps_per_print": 3}
JSON
echo "== resume (ZeRO-3, bf16)"
run tests/deepspeed/scripts/ds_train.py --deepspeed_config "$tmp/ds.json" --steps 6 --out "$tmp/full" | grep "step="
run tests/deepspeed/scripts/ds_train.py --deepspeed_config "$tmp/ds.json" --steps 3 --save_at 3 --save_dir "$tmp/ck" --out "$tmp/a" >/dev/null
run tests/deepspeed/scripts/ds_train.py --deepspeed_config "$tmp/ds.json" --steps 6 --load_dir "$tmp/ck" --out "$tmp/b" >/dev/null
python3 - "$tmp" "$n" <<'PY'
import sys, torch
tmp, n = sys.argv[1], int(sys.argv[2])
for r in range(n):
    full, b = torch.load(f"{tmp}/full.rank{r}.pt"), torch.load(f"{tmp}/b.rank{r}.pt")
    same = all(torch.equal(v, b["params"][k]) for k, v in full["params"].items())
    losses = all(full["losses"][k] == v for k, v in b["losses"].items())
    print(f"rank {r}: resumed params equal {same}, losses equal {losses}, steps {sorted(b['losses'])}")
PY
echo "== cifar10 tutorial (the digits stand-in: no CIFAR-10 on this machine)"
# the tutorial's own device argument: .to(model_engine.local_rank) (the example writes model_engine.device for the CPU)
sed 's/model_engine\.device/model_engine.local_rank/g' examples/cifar10/train.py > "$tmp/cifar10_tutorial.py"
run "$tmp/cifar10_tutorial.py" --deepspeed_config examples/cifar10/ds_config.json --data_dir /nonexistent \
    --compare_with_engine | grep -E "Accuracy of the network|through the engine|Finished|Error|error" | sort | uniq -c
rm -rf "$tmp"
