#!/usr/bin/env bash
# After a GPU run of scripts/gpu_check.sh: copy its result files into docs/bench/ and render docs/runtime.md.
#   bash scripts/take_gpu_results.sh DIR      (DIR: where the run's $OUT files landed, e.g. /work/.device/N)
# Files a run did not produce are left as they were; the README's GPU table is still edited by hand.
set -euo pipefail
src=${1:?usage: take_gpu_results.sh DIR (the folder holding the run's *_h200.json and profile_step.json)}
cd "$(dirname "$0")/.."
copied=0
for pair in runtime_h200.json:runtime_h200.json moe_h200.json:moe_h200.json profile_step.json:profile_step_h200.json \
            attention_h200.json:attention_h200.json; do
  from=${pair%%:*}; to=${pair##*:}
  if [ -f "$src/$from" ]; then
    python3 -c "import json,sys; json.load(open(sys.argv[1]))" "$src/$from"  # a cut-off run leaves bad JSON
    cp "$src/$from" "docs/bench/$to"
    commit=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1])).get('commit') or '')" "$src/$from")
    echo "docs/bench/$to <- $src/$from (commit ${commit:-unknown: run with TWOGRID_COMMIT set, or add it by hand})"
    copied=$((copied + 1))
  fi
done
[ "$copied" -gt 0 ] || { echo "no result files in $src" >&2; exit 1; }
python3 benchmarks/render_runtime_doc.py
echo "rendered docs/runtime.md; now update the README's GPU table from it"
