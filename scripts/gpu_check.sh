#!/usr/bin/env bash
# Every GPU session's one call: the GPU tests, then the runtime benchmark. Run from the repository root on the
# device machine; results and logs go to $OUT (default ./gpu_out).
#   bash scripts/gpu_check.sh [tests] [bench] [moe] [attention] [attention_sweep] [engine] [headline] [replay]
#     [profile_engine] [profile]   (default: all)
# (moe: one MoE layer, grouped GEMM vs Triton tiles; attention: paged attention and logits at serving shapes;
#  attention_sweep: the same plus forced split counts and tile shapes, for tuning models/triton_attention.py;
#  engine: offline EngineCore throughput per capture policy, workload and concurrency, ENGINE_ARGS passed on;
#  headline: twogrid serve per capture policy driven by twogrid bench (HEADLINE_ARGS passed on; needs
#  .gpu_data/smollm2-tokenizer, SmolLM2's tokenizer saved as a directory);
#  replay: twogrid replay --execute of vLLM's list's 256-stream headline trace under separate grids, each recorded
#  step shape re-run on the GPU and timed, against the live separate server's device time (docs/headline.md);
#  profile_engine: where a decode step's GPU time goes through EngineCore (attention, logits, graphs);
#  profile: where one step's time goes, a diagnostic;
#  quant (only when named, not in "all"): bf16 vs --quantization fp8 vs --kv-cache-dtype fp8 on bench-dense and
#  bench-moe through twogrid serve + twogrid bench, QUANT_ARGS passed on (docs/bench/quant_h200.json);
#  tp (only when named, needs the nvidia-h200-x2 kind): the two-GPU tensor-parallel tests, then TP=1 vs TP=2 on
#  bench-dense and bench-moe-large through twogrid serve + twogrid bench, TP_ARGS passed on
#  (docs/bench/tp_h200x2.json); NCCL_NVLS_ENABLE=0 (NVLink multicast off))
# The ShareGPT prompts travel in .gpu_data/sharegpt.json (an ignored folder named in the call's carry).
# The device machine's copy of .git can be older than the tree sent: pass the commit, e.g.
#   export OUT TWOGRID_COMMIT=<git rev-parse --short HEAD here>; bash scripts/gpu_check.sh
set -uo pipefail
OUT=${OUT:-./gpu_out}
mkdir -p "$OUT"
source "$(dirname "$0")/gpu_env.sh"
what=" ${*:-all} "
want() { [[ "$what" == *" $1 "* || "$what" == *" all "* ]]; }
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$OUT/nvidia_smi.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'grouped_mm', hasattr(torch, '_grouped_mm'))"
rc=0
if want tests; then
  python3 -m pytest -m "gpu or kernels" -o addopts= -q -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log"
  rc=${PIPESTATUS[0]}
fi
if want bench; then
  python3 benchmarks/bench_runtime_gpu.py --out "$OUT/runtime_h200.json" 2>&1 | tee "$OUT/bench.log"
  rc=$(( rc || PIPESTATUS[0] ))
fi
if want moe; then
  python3 benchmarks/bench_moe_gpu.py --out "$OUT/moe_h200.json" 2>&1 | tee "$OUT/moe.log"
  rc=$(( rc || PIPESTATUS[0] ))
fi
if want attention; then
  python3 benchmarks/bench_attention_gpu.py --out "$OUT/attention_h200.json" 2>&1 | tee "$OUT/attention.log"
  rc=$(( rc || PIPESTATUS[0] ))
fi
if want attention_sweep; then
  python3 benchmarks/bench_attention_gpu.py --sweep --out "$OUT/attention_sweep_h200.json" 2>&1 \
    | tee "$OUT/attention_sweep.log"
  rc=$(( rc || PIPESTATUS[0] ))
fi
if want engine; then
  python3 benchmarks/bench_engine_gpu.py --data .gpu_data/sharegpt.json --out "$OUT/engine_h200.json" \
    ${ENGINE_ARGS:-} 2>&1 | tee "$OUT/engine.log"
  rc=$(( rc || PIPESTATUS[0] ))
fi
if want headline; then
  python3 benchmarks/bench_headline_gpu.py --data .gpu_data/sharegpt.json --tokenizer .gpu_data/smollm2-tokenizer \
    --out "$OUT/headline_h200.json" ${HEADLINE_ARGS:-} 2>&1 | tee "$OUT/headline.log"
  rc=$(( rc || PIPESTATUS[0] ))
fi
if [[ "$what" == *" quant "* ]]; then
  python3 benchmarks/bench_quant_gpu.py --data .gpu_data/sharegpt.json --tokenizer .gpu_data/smollm2-tokenizer \
    --out "$OUT/quant_h200.json" --log-dir "$OUT" ${QUANT_ARGS:-} 2>&1 | tee "$OUT/quant.log"
  rc=$(( rc || PIPESTATUS[0] ))
fi
if [[ "$what" == *" tp "* ]]; then
  export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
  python3 -m pytest -m gpu -o addopts= -q -p no:cacheprovider tests/test_tensor_parallel_gpu.py 2>&1 \
    | tee "$OUT/tp_tests.log"
  rc=$(( rc || PIPESTATUS[0] ))
  python3 benchmarks/bench_tp_gpu.py --data .gpu_data/sharegpt.json --tokenizer .gpu_data/smollm2-tokenizer \
    --out "$OUT/tp_h200x2.json" --log-dir "$OUT" ${TP_ARGS:-} 2>&1 | tee "$OUT/tp.log"
  rc=$(( rc || PIPESTATUS[0] ))
fi
if want replay; then
  python3 -m dispatcher replay docs/bench/traces/headline_e818375_vllm-default_256.jsonl --platform sm100 \
    --max-num-seqs 1024 --max-num-batched-tokens 16384 \
    --speculative-config '{"method": "eagle3", "num_speculative_tokens": 7}' --execute --model bench-moe --json \
    >"$OUT/replay_execute_h200.json" 2>"$OUT/replay.log"
  rc=$(( rc || $? ))
fi
if want profile_engine; then
  python3 benchmarks/profile_engine_gpu.py --data .gpu_data/sharegpt.json --out "$OUT/profile_engine_h200.json" \
    2>&1 | tee "$OUT/profile_engine.log"
  rc=$(( rc || PIPESTATUS[0] ))
fi
if want profile; then
  python3 benchmarks/profile_step.py --out "$OUT/profile_step.json" 2>&1 | tee "$OUT/profile.log"
  rc=$(( rc || PIPESTATUS[0] ))
fi
exit $rc
