#!/usr/bin/env bash
# The headline table in parts, on one H200, one part a device call (each about
# 5-9 minutes; every part's ratios are taken within its own run):
#   workloads  K = 3, tiers 7/3/1 and no-sd; vllm-default and separate; 64-1024 streams
#   lists      K = 7; vllm-default, separate, SGLang's and TensorRT-LLM's lists (HEADLINE_POLICIES overrides); 64-1024
#              streams
#   models     K = 7 on bench-moe-large and bench-dense; vllm-default and separate; 256 and 512 streams
#   small      K = 3, tiers 7/3/1 and no-sd at 1 and 16 streams; vllm-default and separate taking turns batch by
#              batch (--alternate HEADLINE_SLOTS, default 40, as the K = 7 cells at 57d0e86 in docs/headline.md;
#              HEADLINE_WORKLOADS and HEADLINE_SMALL_CONC narrow it, e.g. one workload at 1 stream with more slots;
#              HEADLINE_POLICIES=vllm-default,separate,vllm-default-twin adds an A/A control: the noise between
#              two servers of one policy)
#   export OUT TWOGRID_COMMIT=<sha>; bash scripts/headline_rest.sh workloads
# Each part stops at HEADLINE_LIMIT_S seconds (default 560; models: half each run) so that what it measured comes
# back; results go to $OUT/<part>/ (headline_h200.json, or one file per model), with the bench results, step traces
# and server logs packed into bench.tgz, traces.tgz and logs.tgz (scripts/pack_gpu_out.py).
set -uo pipefail
OUT=${OUT:-./gpu_out}
LIMIT=${HEADLINE_LIMIT_S:-560}
CONC=${HEADLINE_CONC:-64,128,256,512,1024}
SLOTS=${HEADLINE_SLOTS:-40}
part=${1:?"name a part: workloads, lists, models or small"}
case $part in workloads|lists|models|small) ;; *) echo "unknown part: $part (workloads, lists, models or small)" >&2
  exit 2 ;; esac
source "$(dirname "$0")/gpu_env.sh"
mkdir -p "$OUT/$part"
common=(--data .gpu_data/sharegpt.json --tokenizer .gpu_data/smollm2-tokenizer --fixed-acceptance 3.0 --waves 2
        --min-prompts 16 --overhead-at 0 --no-prime-cache)
run() {  # run <out name> <args...>: one bench_headline_gpu.py, its log beside its JSON (on timeout's SIGTERM it
  # stops its servers before it exits; -k: killed 60 s later if not)
  local name=$1
  shift
  timeout -k 60 "$LIMIT" python3 benchmarks/bench_headline_gpu.py "${common[@]}" "$@" \
    --out "$OUT/$part/$name.json" >"$OUT/$part/$name.log" 2>&1
  local rc=$?
  tail -n 20 "$OUT/$part/$name.log"
  return $rc
}
case $part in
  workloads)
    run headline_h200 --policies vllm-default,separate --workloads eagle3-k3,eagle3-tiers-7-3-1,no-sd \
      --concurrency "$CONC" --step-trace-dir "$OUT/$part/traces"
    rc=$? ;;
  lists)
    run headline_h200 --policies "${HEADLINE_POLICIES:-vllm-default,separate,sglang,trtllm}" --workloads eagle3-k7 \
      --concurrency "$CONC" --step-trace-dir "$OUT/$part/traces"
    rc=$? ;;
  small)
    run headline_h200_small --policies "${HEADLINE_POLICIES:-vllm-default,separate}" \
      --workloads "${HEADLINE_WORKLOADS:-eagle3-k3,eagle3-tiers-7-3-1,no-sd}" --concurrency "${HEADLINE_SMALL_CONC:-1,16}" \
      --waves 1 --interleave 0 --alternate "$SLOTS"
    rc=$? ;;
  models)
    LIMIT=$(( LIMIT / 2 ))  # two runs in one call
    run headline_h200_bench-moe-large --model bench-moe-large --policies vllm-default,separate \
      --workloads eagle3-k7 --concurrency 256,512
    rc=$?
    run headline_h200_bench-dense --model bench-dense --policies vllm-default,separate --workloads eagle3-k7 \
      --concurrency 256,512
    rc2=$?
    rc=$(( rc ? rc : rc2 )) ;;
esac
rc=${rc:-0}
python3 scripts/pack_gpu_out.py "$OUT/$part"  # (bench/, traces/ and the servers' logs as archives: few files)
exit $rc
