#!/usr/bin/env bash
# Samples every front end of the servers a benchmark starts (front end 0, `dispatcher serve`, and 1..N,
# `dispatcher.serve.frontend`) with py-spy for DURATION_S seconds (default 60) once COUNT front ends are up (default 8:
# two servers of four), active samples only: where the front ends' CPU goes (preprocessing a prompt, streaming
# tokens). One raw file a process in DIR, named by its server's prefix caching (on/off, from front end 0's flags)
# and pid. Needs the py-spy wheel in .whl (scripts/gpu_env.sh installs it). Start it in the background first:
#   (bash scripts/gpu_spy_front_ends.sh $OUT/spy &); python benchmarks/bench_prefix_cache_gpu.py ...
#   python scripts/spy_top.py ...   # or any summary of py-spy's raw stacks
set -uo pipefail
dir=${1:?usage: bash scripts/gpu_spy_front_ends.sh DIR}
spy=$(command -v py-spy || echo /tmp/site/bin/py-spy)
mkdir -p "$dir"
pids() { pgrep -f "[d]ispatcher serve|[d]ispatcher.serve.frontend"; }
for _ in $(seq 600); do [ "$(pids | wc -l)" -ge "${COUNT:-8}" ] && break; sleep 0.5; done
for pid in $(pids); do
  root=$pid
  grep -q "dispatcher.serve.frontend" "/proc/$pid/cmdline" 2>/dev/null && root=$(ps -o ppid= -p "$pid" | tr -d ' ')
  label=on; tr '\0' ' ' < "/proc/$root/cmdline" 2>/dev/null | grep -q -- "--no-enable-prefix-caching" && label=off
  "$spy" record -p "$pid" -d "${DURATION_S:-60}" -r 200 -f raw --nonblocking -o "$dir/fe_${label}_$pid.raw" \
    > /dev/null 2>&1 &
done
wait
