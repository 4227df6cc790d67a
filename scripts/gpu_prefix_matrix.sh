#!/usr/bin/env bash
# Issue 30's served matrix at this commit (both models, multi-turn / prefix-repetition / no-prefix, 16-1024 streams,
# caching on and off) and issue 31's sampling split, in one lease of four calls made within the machine's 30 s warm
# window, each from the repository root with C set to the commit (jobs in the background: scripts/gpu_background.sh):
#   call 1: carry [".whl", ".gpu_data", ".gpu_gguf/p00", ".gpu_tools"]   C=<commit> bash scripts/gpu_prefix_matrix.sh 1
#           in the background: the sampling split at 256 streams (bench-moe, three rounds; NO_SPLIT=1: not run), then
#           bench-moe's matrix
#   call 2: carry [".gpu_gguf/p01", ".gpu_tools"]                          ... 2   (waits; what is done comes back)
#   call 3: carry [".gpu_gguf/p02", ".gpu_tools"]                          ... 3   (GGUF joined; in the background,
#           once call 1's job is done: the default model's matrix, then its multi-turn and no-prefix cells at 256
#           streams with API_SERVERS front ends (default 8; 0: not run), mixed steps PIECEWISE (the default) and on
#           FULL graphs, the question being whether the ~10 ms a turn waits in 4 front ends during a burst keeps it
#           from 2x)
#   call 4: carry [".gpu_tools"]                                           ... 4   (waits; repeat while it runs; the
#           last, once the job is done, stops the servers)
# Every matrix runs at 4,096 tokens a step (every mixed step within the PIECEWISE graphs: 16,384 ran a burst's steps
# eagerly, docs/reference.md), ROUNDS rounds a cell (default 1; the 256-stream cells have three-round runs of their
# own in docs/bench). Results: prefix_cache_$GPU.json (both models' rows, --resume), sampling_split_$GPU.json,
# prefix_mt_budget4096_api<N>_$GPU.json, prefix_mt_fullmixed_api<N>_$GPU.json, and pm_rest.tgz (logs; step traces
# are not kept: 24 cells a model).
set -uo pipefail
kill_servers() {
  pkill -f '[b]ench_sampling_gpu'; pkill -f '[b]ench_prefix_cache_gpu'; pkill -f '[d]ispatcher serve'; sleep 1
  kill_gpu_procs
}
results() {
  mkdir -p "$OUT/x"
  cp /root/bg/pm/prefix_*.json /root/bg/pm/sampling_*.json "$OUT/x/" 2>/dev/null
  (cd /root/bg && tar czf "$OUT/x/pm_rest.tgz" --exclude='conversations-*.json' --exclude='*.json' \
     pm.log pm1.log pm 2>/dev/null)
  ls -la "$OUT/x"
}
matrix() {  # MODEL: one model's cells into the shared result (--resume: the other model's rows kept); each server's
  # KV cache the benchmark's default, a third of the GPU's memory (~26 GiB on an H100: 1024 conversations' histories
  # outgrow it at the fourth turn, which the rows flag as kv_pool_short_rounds)
  echo "python benchmarks/bench_prefix_cache_gpu.py --data $D --tokenizer $T --models $1 \
--concurrency 16,64,256,1024 --rounds ${ROUNDS:-1} --max-num-batched-tokens 4096 --resume \
--out /root/bg/pm/prefix_cache_$GPU.json; "
}
case "${1:-}" in
  1) bash scripts/gpu_chain.sh 1
     source scripts/gpu_session.sh "${C:?set C to the commit}"; source scripts/gpu_background.sh
     mkdir -p /root/bg/pm; runs=""
     if [ -z "${NO_SPLIT:-}" ]; then
       runs+="python benchmarks/bench_sampling_gpu.py --data $D --tokenizer $T --rounds 3 --no-prime-cache"
       runs+=" --variants sampled,penalties,structured,penalized --extra-body $(printf %q "$(cat .gpu_tools/schema.json)")"
       runs+=" --out /root/bg/pm/sampling_split_$GPU.json; "
     fi
     runs+=$(matrix bench-moe)
     bg_start pm1 bash -c "$runs"
     bg_wait pm1 "${LIM:-200}" ;;
  2) bash scripts/gpu_chain.sh 2
     source scripts/gpu_session.sh "${C:?set C to the commit}"; source scripts/gpu_background.sh
     bg_wait pm1 "${LIM:-300}"; results ;;
  3) mkdir -p .gpu_data && cp .gpu_tools/sharegpt.json .gpu_data/ && bash scripts/gpu_chain.sh 3 || exit 1
     source scripts/gpu_session.sh "${C:?set C to the commit}"; source scripts/gpu_background.sh
     if bg_done pm1; then kill_servers; fi  # (call 1's job may still run: its servers stay)
     mkdir -p /root/bg/pm
     # (call 1's job first, at most 20 minutes: two benchmarks on one GPU would measure each other)
     runs="for i in \$(seq 600); do [ -e /root/bg/pm1.log ] && ! grep -q '^BG_DONE' /root/bg/pm1.log || break; sleep 2; done; "
     runs+=$(matrix default)
     api=${API_SERVERS:-8}
     if [ "$api" != 0 ]; then  # (the default PIECEWISE mixed steps, then FULL mixed)
       for cc in "" "{\"max_full_mixed_cudagraph_capture_tokens\": 4096}"; do
         runs+="python benchmarks/bench_prefix_cache_gpu.py --data $D --tokenizer $T --models default"
         runs+=" --workloads multi-turn,no-prefix --concurrency 256 --rounds 3 --kv-gib 8 --max-num-batched-tokens 4096"
         runs+=" --api-server-count $api"
         if [ -n "$cc" ]; then
           runs+=" --compilation-config '$cc' --out /root/bg/pm/prefix_mt_fullmixed_api${api}_$GPU.json; "
         else
           runs+=" --out /root/bg/pm/prefix_mt_budget4096_api${api}_$GPU.json; "
         fi
       done
     fi
     bg_start pm bash -c "$runs"
     bg_wait pm "${LIM:-560}"; results ;;
  4) source scripts/gpu_session.sh "${C:?set C to the commit}"; source scripts/gpu_background.sh
     bg_wait pm "${LIM:-560}"; results
     # (the servers only once the job is done: kill_servers' patterns match the job's own command line)
     if bg_done pm; then kill_servers; fi ;;
  *) echo "usage: C=<commit> bash scripts/gpu_prefix_matrix.sh 1|2|3|4" >&2; exit 2 ;;
esac
