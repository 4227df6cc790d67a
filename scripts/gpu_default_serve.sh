#!/usr/bin/env bash
# The quick start's `twogrid serve` as a user runs it (no flags: the default model, its defaults), started N times
# (default 2: the first with the Triton cache as the machine has it, the next warm): seconds from the process start
# to /health 200 and to a first token, the graphs captured then and 10 s later, and the start-up's log lines. From
# the repository root on the device, after scripts/gpu_chain.sh 3 (the GGUF in place) and scripts/gpu_session.sh
# (R, the wheels):  bash scripts/gpu_default_serve.sh [N [TAG]]   (TAG: the logs' names, default-serve[-TAG]-i; e.g.
# a start under TWOGRID_PROFILE_DIR, whose timings are the profiler's, kept apart from the timed ones); SERVE_ARGS:
# flags added to serve's (e.g. another model: --model bench-moe --tokenizer .gpu_data/smollm2-tokenizer)
set -uo pipefail
port=8200
now() { python3 -c 'import time; print(time.time())'; }
since() { python3 -c "print(f'{$(now) - $1:.2f}')"; }
graphs() { curl -s "localhost:$port/metrics" | grep -E '^twogrid:cudagraphs_(planned|captured)' | awk '{s[$1 ~ /planned/ ? "planned" : "captured"] += $2} END {printf "%d of %d graphs captured", s["captured"], s["planned"]}'; }
name=default-serve${2:+-$2}
for i in $(seq "${1:-2}"); do
  t0=$(now)
  python -m dispatcher serve --port "$port" ${SERVE_ARGS:-} > "$R/$name-$i.log" 2>&1 &
  pid=$!
  until curl -sf -o /dev/null "localhost:$port/health"; do
    kill -0 "$pid" 2>/dev/null || { echo "start $i: the server exited"; tail -5 "$R/$name-$i.log"; exit 1; }
    sleep 0.05
  done
  health=$(since "$t0"); at_health=$(graphs)
  curl -s "localhost:$port/v1/completions" -H 'Content-Type: application/json' \
    -d '{"prompt": "The capital of France is", "max_tokens": 1}' > "$R/$name-$i.json"
  first=$(since "$t0")
  sleep 10
  echo "start $i: /health 200 at $health s ($at_health), first token at $first s; 10 s later $(graphs)"
  kill "$pid"; wait "$pid"
  grep -E "delayed capture|worker ready|front end set up" "$R/$name-$i.log" | cut -c1-400
done
