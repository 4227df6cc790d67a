#!/usr/bin/env bash
# Auto tiers against every fixed K, served (issue 29), in four calls made within the machine's 30 s warm window, each
# from the repository root with C set to the commit (the jobs run in the background: scripts/gpu_background.sh):
#   call 1: carry [".whl", ".gpu_data", ".gpu_gguf/p00", ".gpu_tools"]   C=<commit> bash scripts/gpu_auto_tiers.sh 1
#           bench-moe (random weights, acceptance fixed at 3.0 of K = 7: the machinery) at 64-1024 streams
#   call 2: carry [".gpu_gguf/p01", ".gpu_tools"]                          ... 2   (waits for it; its results back
#           in this call: a machine taken back during a later call loses what is still on it)
#   call 3: carry [".gpu_gguf/p02", ".gpu_tools"]                          ... 3   (GGUF joined; the default model's
#           drafter tests, the float32 attention test and the served structured-outputs test first (their results
#           back in this call), then, in the background, the default model with its shipped head, real acceptance:
#           no SD, K = 3 / 4 / 5, auto up to 5, 16-1024 streams, three rounds)
#   call 4: carry [".gpu_tools"]                                           ... 4   (waits for it; its results back;
#           repeat it while the job runs: the last, once it is done, stops the servers)
#   call 5 (optional): carry [".gpu_tools"]                                ... 5   (py-spy on a K = 3 server at 1024
#           streams: where the host's part of a step goes, scripts/spy_top.py's summary of engine and worker)
# .gpu_tools holds sharegpt.json (scripts/gpu_carry.sh puts it in .gpu_data, which calls 2-4 do not carry).
# Each JSON's rows carry vs_best_fixed (auto against the best fixed K, round by round): issue 29 asks 0.97x.
# Result files are named by the card (GPU: h200 or h100, scripts/gpu_session.sh).
# NO_TESTS=1 (call 3): the GPU tests not run; METHODS and CONCS (call 3): the matrix's methods and concurrencies
# (defaults: none,eagle3:3,eagle3:4,eagle3:5,eagle3:auto5 at 16,64,256,1024), for a short device budget.
# NO_MOE=1 (calls 1 and 2): the GGUF pieces carried and the wheels installed, bench-moe not run (it has its results;
# the default model's matrix is what a short device budget buys).
set -uo pipefail
kill_servers() {
  pkill -f '[b]ench_spec_gpu'; pkill -f '[d]ispatcher serve'; sleep 1
  kill_gpu_procs
}
case "${1:-}" in
  1) bash scripts/gpu_chain.sh 1
     source scripts/gpu_session.sh "${C:?set C to the commit}"; source scripts/gpu_background.sh
     [ -z "${NO_MOE:-}" ] || exit 0
     mkdir -p /root/bg/moe
     bg_start moe python benchmarks/bench_spec_gpu.py --data "$D" --model bench-moe --tokenizer "$T" \
       --fixed-acceptance 3.0 --fixed-acceptance-of 7 --methods none,eagle3:1,eagle3:3,eagle3:auto7 \
       --policies separate --concurrency 64,256,1024 --waves 4 --min-prompts 16 --together --rounds 3 --kv-gib 8 \
       --out /root/bg/moe/spec_auto_moe_$GPU.json
     bg_wait moe "${LIM:-200}" ;;
  2) bash scripts/gpu_chain.sh 2; [ -z "${NO_MOE:-}" ] || exit 0
     source scripts/gpu_session.sh "${C:?set C to the commit}"; source scripts/gpu_background.sh
     bg_wait moe "${LIM:-300}"
     mkdir -p "$OUT/x"; cp /root/bg/moe.log /root/bg/moe/*.json "$OUT/x/" 2>/dev/null; ls "$OUT/x" ;;
  3) mkdir -p .gpu_data && cp .gpu_tools/sharegpt.json .gpu_data/ && bash scripts/gpu_chain.sh 3 || exit 1
     source scripts/gpu_session.sh "${C:?set C to the commit}"; source scripts/gpu_background.sh
     bg_wait moe 5
     mkdir -p "$OUT/x"; cp /root/bg/moe.log /root/bg/moe/*.json "$OUT/x/" 2>/dev/null
     kill_servers  # (bench-moe's job too if it still runs: the GPU tests and the matrix need the GPU to themselves)
     [ -n "${NO_TESTS:-}" ] || TAILN=14 part gputests 360 python -m pytest -o addopts= -q -rs -p no:cacheprovider \
       tests/test_default_model_drafters.py tests/test_kernels.py::test_float32_attention_on_the_gpu_computes_in_float32 \
       tests/test_structured_gpu.py::test_every_constraint_gives_valid_output_served_on_the_gpu
     cp "$R/gputests.log" "$OUT/x/" 2>/dev/null; mkdir -p /root/bg/dm
     bg_start dm python benchmarks/bench_spec_gpu.py --data "$D" \
       --methods "${METHODS:-none,eagle3:3,eagle3:4,eagle3:5,eagle3:auto5}" --policies separate \
       --concurrency "${CONCS:-16,64,256,1024}" \
       --waves 4 --min-prompts 16 --together --rounds 3 --kv-gib 8 --step-trace-dir /root/bg/dm/traces \
       --out /root/bg/dm/spec_auto_$GPU.json
     bg_wait dm "${LIM:-560}"; ls "$OUT/x" ;;
  4) source scripts/gpu_session.sh "${C:?set C to the commit}"; source scripts/gpu_background.sh
     bg_wait dm "${LIM:-500}"
     mkdir -p "$OUT/x"; cp /root/bg/dm.log /root/bg/dm/*.json "$OUT/x/" 2>/dev/null
     tar czf "$OUT/x/dm_traces.tgz" -C /root/bg/dm traces 2>/dev/null
     python benchmarks/trace_by_kind.py /root/bg/dm/traces/*.jsonl --requests 900-1024 \
       --out "$OUT/x/by_kind_1024_$GPU.json" | grep -v '^  ' ;
     python benchmarks/trace_by_kind.py /root/bg/dm/traces/*.jsonl --requests 200-256 \
       --out "$OUT/x/by_kind_256_$GPU.json" | grep -v '^  ' ;
     # (the servers only once the job is done: kill_servers' patterns match the job's own command line, and a call
     # 4 that returns while it runs is repeated: gpu_prefix_budgets.sh lost a benchmark that way)
     if bg_done dm; then kill_servers; fi; ls -la "$OUT/x" ;;
  5) # (optional, after 4 within the warm window: where the host's ~2 ms a step at 1024 streams goes) one eagle3 K = 3
     # server at 1024 streams, its engine and worker sampled by py-spy; the raw stacks and their summary come back
     source scripts/gpu_session.sh "${C:?set C to the commit}"
     mkdir -p "$OUT/x" /root/spy; (bash scripts/gpu_spy.sh /root/spy &)
     TAILN=4 part spy "${LIM:-300}" python benchmarks/bench_spec_gpu.py --data "$D" --methods eagle3:3 \
       --policies separate --concurrency 1024 --waves 4 --min-prompts 16 --rounds 1 --kv-gib 8 \
       --out /root/spy/spec_spy_$GPU.json
     python scripts/spy_top.py /root/spy --process e --top 25 > "$OUT/x/spy_engine.txt" 2>&1
     python scripts/spy_top.py /root/spy --process w --top 25 > "$OUT/x/spy_worker.txt" 2>&1
     tar czf "$OUT/x/spy_raw.tgz" -C /root spy; head -40 "$OUT/x/spy_worker.txt" ;;
  *) echo "usage: C=<commit> bash scripts/gpu_auto_tiers.sh 1|2|3|4|5" >&2; exit 2 ;;
esac
