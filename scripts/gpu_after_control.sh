#!/usr/bin/env bash
# Issue 33's "after capture within 2%": is the gap a delayed server's, or the pair's (the second server started, on
# the next port)? One call, bench-moe (no GGUF), 1024 streams, three alternated rounds each: an A/A control (two
# capture-first servers) and the A/B (capture-first, delayed), in that order:
#   carry [".whl", ".gpu_data"]   C=<commit> bash scripts/gpu_after_control.sh
# Result: after_control_moe_$GPU.json (rows by "modes") and rest.tgz (the server logs).
set -uo pipefail
source scripts/gpu_session.sh "${C:?set C to the commit}"
for modes in capture-first,capture-first capture-first,delayed; do
  part "after-$modes" "${LIM:-270}" python benchmarks/bench_startup_gpu.py --part capture --data "$D" --tokenizer "$T" \
    --models bench-moe --workloads no-sd --no-during --after-modes "$modes" --concurrency-after 1024 --rounds 3 \
    --out "$R/after_control_moe_$GPU.json"
done
finish
