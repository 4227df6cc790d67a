#!/usr/bin/env bash
# The headline over two GPUs of one host (nvidia-h200-x2), in one call: GPU 0 runs EAGLE-3 K = 7 under every
# policy (and the serving-overhead rows), GPU 1 the other workloads under vllm-default and separate grids. Every
# ratio is taken within one GPU's run (bench_headline_gpu.py computes bound_ratio and tok_s_ratio per file);
# scripts/merge_headline.py joins the two files into docs/bench/headline_h200.json.
#   export OUT TWOGRID_COMMIT=<sha>; bash scripts/headline_two_gpus.sh
# Each half stops at HEADLINE_LIMIT_S seconds (default 540) so that what it measured comes back.
set -uo pipefail
OUT=${OUT:-./gpu_out}
LIMIT=${HEADLINE_LIMIT_S:-540}
CONC=${HEADLINE_CONC:-1,16,64,128,256,512,1024}
source "$(dirname "$0")/gpu_env.sh"
mkdir -p "$OUT/k7" "$OUT/other"
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv | tee "$OUT/nvidia_smi.txt"
common=(--data .gpu_data/sharegpt.json --tokenizer .gpu_data/smollm2-tokenizer --fixed-acceptance 3.0
        --concurrency "$CONC" --waves 2 --min-prompts 16)
CUDA_VISIBLE_DEVICES=0 timeout "$LIMIT" python3 benchmarks/bench_headline_gpu.py "${common[@]}" --port 8123 \
  --policies vllm-default,separate,sglang,trtllm --workloads eagle3-k7 --overhead-at 256 \
  --out "$OUT/k7/headline_h200.json" --step-trace-dir "$OUT/k7/traces" >"$OUT/k7/headline.log" 2>&1 &
first=$!
CUDA_VISIBLE_DEVICES=1 timeout "$LIMIT" python3 benchmarks/bench_headline_gpu.py "${common[@]}" --port 8223 \
  --policies vllm-default,separate --workloads eagle3-k3,eagle3-tiers-7-3-1,no-sd --overhead-at 0 \
  --out "$OUT/other/headline_h200.json" --step-trace-dir "$OUT/other/traces" >"$OUT/other/headline.log" 2>&1
rc=$?
wait $first
rc=$(( rc || $? ))
tail -n 40 "$OUT/k7/headline.log" "$OUT/other/headline.log"
exit $rc
