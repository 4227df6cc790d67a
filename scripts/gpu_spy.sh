#!/usr/bin/env bash
# Samples a running server's engine and worker processes with py-spy, in windows of WINDOW_S seconds (default 4),
# while the engine lives: where each process's threads spend their time (idle waits included), a diagnostic for a
# benchmark that runs beside it. Needs the py-spy wheel in .whl (scripts/gpu_carry.sh downloads it); the raw stacks
# go to DIR (e<i>.raw: the engine, w<i>.raw: the worker, t<i>: each window's start), summarized by
# scripts/spy_top.py. Start it in the background before the benchmark:
#   (bash scripts/gpu_spy.sh $OUT/spy &); python3 benchmarks/bench_sampling_gpu.py ...
#   python3 scripts/spy_top.py $OUT/spy      # here, after the call: the busiest windows' top frames
set -uo pipefail
dir=${1:?usage: bash scripts/gpu_spy.sh DIR}
window=${WINDOW_S:-4}
spy=$(command -v py-spy || echo /tmp/site/bin/py-spy)
mkdir -p "$dir"
for _ in $(seq 600); do pgrep -f "[d]ispatcher.engine.service" >/dev/null && break; sleep 0.5; done
i=0
while pgrep -f "[d]ispatcher.engine.service" >/dev/null; do
  engine=$(pgrep -f "[d]ispatcher.engine.service" | head -1)
  worker=$(pgrep -f "[d]ispatcher.runtime.process" | head -1)
  date +%T.%N > "$dir/t$i"
  for pair in "e:$engine" "w:$worker"; do
    [[ -n "${pair#*:}" ]] && "$spy" record -p "${pair#*:}" -d "$window" -r 400 -f raw --idle --threads --nonblocking \
      -o "$dir/${pair%%:*}$i.raw" >/dev/null 2>&1 &
  done
  wait
  i=$((i + 1))
done
