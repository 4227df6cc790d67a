#!/usr/bin/env bash
# Issue 30's multi-turn TTFT and issue 31's split, served (one lease of four calls made within the machine's 30 s
# warm window, each from the repository root with C set to the commit; jobs run in the background:
# scripts/gpu_background.sh):
#   call 1: carry [".whl", ".gpu_data", ".gpu_gguf/p00", ".gpu_tools"]   C=<commit> bash scripts/gpu_prefix_budgets.sh 1
#           bench-moe, in the background: the sampling split at 256 streams (issue 31's 0.9x; .gpu_tools/schema.json
#           is the schema), on an H200 only (SPLIT=1: on an H100 too); then multi-turn and no-prefix at 256 streams,
#           caching on and off, three rounds, 4,096 tokens a step, with a pool that holds every conversation's
#           history (MOE_KV_GIB, default 16 a server: ~350,000 tokens against the fourth turn's ~210,000; 8 GiB
#           evicted them, docs/reference.md; 0: not run)
#   call 2: carry [".gpu_gguf/p01", ".gpu_tools"]                          ... 2   (waits for it; its results back)
#   call 3: carry [".gpu_gguf/p02", ".gpu_tools"]                          ... 3   (GGUF joined; in the background: the
#           whole GPU suite (`-m 'gpu or kernels'`; NO_TESTS=1 skips it), then the default model's multi-turn and
#           no-prefix workloads at 256 streams, caching on and off, three rounds, at each of BUDGETS tokens a step
#           (default "4096 8192"; BUDGETS="": none) with step traces; the no-prefix cells with
#           a large KV pool too (NO_PREFIX_KV_GIB, default 30: two servers share an H100; ~87,000 blocks each),
#           where evicting cached blocks is what a full pool costs; 0: not run); and at 4,096 tokens a step with
#           mixed steps of up to FULL_MIXED tokens (default 4096; 0: not run) on FULL graphs
#           (API_SERVERS=N: every default-model server of call 3 with N front ends, the benchmark's default 4, and
#           its results named _api<N>: a burst of 256 turns queues ~64 arrivals in each of 4 front ends, ~10 ms of
#           a turn's TTFT with caching on, docs/reference.md)
#   call 4: carry [".gpu_tools"]                                           ... 4   (waits; results and traces back)
# Call 4 may be repeated while the job runs (each brings back what is done so far; the last, once it is done, stops
# the servers).
# Result files are named by the card (GPU: h200 or h100, scripts/gpu_session.sh).
set -uo pipefail
kill_servers() {
  pkill -f '[b]ench_sampling_gpu'; pkill -f '[b]ench_prefix_cache_gpu'; pkill -f '[d]ispatcher serve'; sleep 1
  kill_gpu_procs
}
# results: the benchmarks' result JSONs one by one, everything else of /root/bg/pc (logs, step traces, the per-run
# JSONs) in one pc_rest.tgz (a call brings back 8 files; the conversation files are left: each run rewrites them)
results() {
  (cd /root/bg/pc 2>/dev/null && for f in prefix_*.json; do [ -e "$f" ] && cp "$f" "$OUT/x/"; done
   tar czf "$OUT/x/pc_rest.tgz" --exclude='conversations-*.json' --exclude='prefix_*.json' . 2>/dev/null)
}
case "${1:-}" in
  1) bash scripts/gpu_chain.sh 1
     source scripts/gpu_session.sh "${C:?set C to the commit}"; source scripts/gpu_background.sh
     mkdir -p /root/bg/split /root/bg/pc
     runs=""
     # (the split was measured on the H100 (docs/bench/sampling_split_h100.json); issue 31 asks it of the H200)
     if [ "$GPU" = h200 ] || [ -n "${SPLIT:-}" ]; then
       runs+="python benchmarks/bench_sampling_gpu.py --data $D --tokenizer $T --rounds 3 --no-prime-cache"
       runs+=" --variants sampled,penalties,structured,penalized --extra-body $(printf %q "$(cat .gpu_tools/schema.json)")"
       runs+=" --out /root/bg/split/sampling_split_$GPU.json; "
     fi
     kv=${MOE_KV_GIB:-16}
     if [ "$kv" != 0 ]; then
       runs+="python benchmarks/bench_prefix_cache_gpu.py --data $D --tokenizer $T --models bench-moe"
       runs+=" --workloads multi-turn,no-prefix --concurrency 256 --rounds 3 --kv-gib $kv --max-num-batched-tokens 4096"
       runs+=" --step-trace-dir /root/bg/pc/traces_moe --out /root/bg/pc/prefix_mt_moe_kv${kv}_$GPU.json; "
     fi
     [ -n "$runs" ] || { echo "nothing for call 1 on $GPU"; exit 0; }
     bg_start split bash -c "$runs"
     bg_wait split "${LIM:-200}" ;;
  2) bash scripts/gpu_chain.sh 2
     source scripts/gpu_session.sh "${C:?set C to the commit}"; source scripts/gpu_background.sh
     bg_wait split "${LIM:-300}"
     mkdir -p "$OUT/x"; cp /root/bg/split.log /root/bg/split/*.json "$OUT/x/" 2>/dev/null; results; ls "$OUT/x" ;;
  3) mkdir -p .gpu_data && cp .gpu_tools/sharegpt.json .gpu_data/ && bash scripts/gpu_chain.sh 3 || exit 1
     source scripts/gpu_session.sh "${C:?set C to the commit}"; source scripts/gpu_background.sh
     if bg_done split; then kill_servers; fi  # (call 1's job may still run: its servers stay)
     mkdir -p "$OUT/x" /root/bg/pc
     api="" tag=""; [ -z "${API_SERVERS:-}" ] || { api=" --api-server-count $API_SERVERS"; tag="_api$API_SERVERS"; }
     # (call 1's job first: two benchmarks on one GPU would measure each other)
     # (at most 20 minutes: a job killed before its end writes no BG_DONE)
     runs="for i in \$(seq 600); do [ -e /root/bg/split.log ] && ! grep -q '^BG_DONE' /root/bg/split.log || break; sleep 2; done; "
     # the whole GPU suite first, in the job (a call runs 600 s at most; it outlives this one)
     [ -n "${NO_TESTS:-}" ] || runs+="python -m pytest -m 'gpu or kernels' -o addopts= -q -rs -p no:cacheprovider tests \
> /root/bg/pc/gputests.log 2>&1; tail -25 /root/bg/pc/gputests.log; pkill -f '[d]ispatcher serve'; sleep 2; "
     for b in ${BUDGETS-4096 8192}; do  # (BUDGETS="": none)
       runs+="python benchmarks/bench_prefix_cache_gpu.py --data $D --tokenizer $T --models default"
       runs+=" --workloads multi-turn,no-prefix --concurrency 256 --rounds 3 --kv-gib 8 --max-num-batched-tokens $b$api"
       runs+=" --step-trace-dir /root/bg/pc/traces$b$tag --out /root/bg/pc/prefix_mt_budget${b}${tag}_$GPU.json; "
     done
     # the bursts' mixed steps on FULL graphs (>= 5 ms a PIECEWISE mixed step on this 30-layer model, whatever its
     # size; FULL_MIXED=0: not run)
     if [ "${FULL_MIXED:-4096}" != 0 ]; then
       # (its test first, the suite or not: FULL mixed graphs over cached prefixes give PIECEWISE's tokens)
       runs+="python -m pytest -m gpu -o addopts= -q -p no:cacheprovider tests/test_attention.py -k cached_prefixes"
       runs+=" > /root/bg/pc/fullmixed_test.log 2>&1; tail -3 /root/bg/pc/fullmixed_test.log; "
       runs+="python benchmarks/bench_prefix_cache_gpu.py --data $D --tokenizer $T --models default"
       runs+=" --workloads multi-turn,no-prefix --concurrency 256 --rounds 3 --kv-gib 8 --max-num-batched-tokens 4096$api"
       runs+=" --compilation-config '{\"max_full_mixed_cudagraph_capture_tokens\": ${FULL_MIXED:-4096}}'"
       runs+=" --step-trace-dir /root/bg/pc/traces_fullmixed$tag --out /root/bg/pc/prefix_mt_fullmixed${tag}_$GPU.json; "
     fi
     if [ "${NO_PREFIX_KV_GIB:-30}" != 0 ]; then  # (0: not run)
       runs+="python benchmarks/bench_prefix_cache_gpu.py --data $D --tokenizer $T --models default"
       runs+=" --workloads no-prefix --concurrency 256,1024 --rounds 3 --kv-gib ${NO_PREFIX_KV_GIB:-30}$api"
       runs+=" --out /root/bg/pc/prefix_noprefix_kv${NO_PREFIX_KV_GIB:-30}${tag}_$GPU.json"
     fi
     bg_start pc bash -c "$runs"
     bg_wait pc "${LIM:-560}"; ls "$OUT/x" ;;
  4) source scripts/gpu_session.sh "${C:?set C to the commit}"; source scripts/gpu_background.sh
     bg_wait pc "${LIM:-560}"
     mkdir -p "$OUT/x"; cp /root/bg/pc.log "$OUT/x/" 2>/dev/null; results
     # (the servers only once the job is done: a call that returns while it runs leaves them to it; killing them
     # here stopped a benchmark mid-round, and its pkill patterns match the job's own command line too)
     if bg_done pc; then kill_servers; fi; ls -la "$OUT/x" ;;
  *) echo "usage: C=<commit> bash scripts/gpu_prefix_budgets.sh 1|2|3|4" >&2; exit 2 ;;
esac
