#!/usr/bin/env bash
# Issue 33's "after capture within 2%": is a gap the delayed server's, or the pair's (the second server started, on
# the next port)? An A/A control (two capture-first servers), then the A/B (capture-first, delayed), ROUNDS
# alternated rounds each (default 3) at CONC streams (default 1024), MODEL (default bench-moe) and WORKLOAD (default
# no-sd), from the repository root with C set to the commit:
#   bench-moe, one call:   carry [".whl", ".gpu_data"]       C=<commit> bash scripts/gpu_after_control.sh
#   the default model, three calls within the 30 s warm window (its GGUF in three pieces):
#                          carry [".whl", ".gpu_data", ".gpu_gguf/p00"]   ... gpu_after_control.sh 1
#                          carry [".gpu_gguf/p01"]                       ... gpu_after_control.sh 2
#                          carry [".gpu_gguf/p02"]   MODEL=default WORKLOAD=eagle3-k7 CONC=256,1024 ROUNDS=5 ... 3
#                          (about 400 s)
# Result: after_control_<model>_$GPU.json (rows by "modes") and rest.tgz (the server logs).
set -uo pipefail
case "${1:-run}" in
  1|2) bash scripts/gpu_chain.sh "$1"; exit ;;
  3) bash scripts/gpu_chain.sh 3 || exit 1 ;;
  run) ;;
  *) echo "usage: C=<commit> [MODEL=...] bash scripts/gpu_after_control.sh [1|2|3]" >&2; exit 2 ;;
esac
source scripts/gpu_session.sh "${C:?set C to the commit}"
model=${MODEL:-bench-moe}
for modes in capture-first,capture-first capture-first,delayed; do
  part "after-${modes/,/-}" "${LIM:-290}" python benchmarks/bench_startup_gpu.py --part capture --data "$D" \
    --tokenizer "$T" --models "$model" --workloads "${WORKLOAD:-no-sd}" --no-during --after-modes "$modes" \
    --concurrency-after "${CONC:-1024}" --rounds "${ROUNDS:-3}" --out "$R/after_control_${model}_$GPU.json"
done
finish
