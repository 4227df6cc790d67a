#!/usr/bin/env bash
# GPU work that outlives one device call (a call runs 600 s at most; the machine stays warm 30 s after it, and what
# runs outside the call's tree keeps running). Sourced after scripts/gpu_session.sh, from the repository root:
#
#   bg_start NAME cmd...    copy the tree to /root/tg.<this call's pid> once per call (no .git, .whl, .gpu_gguf: a
#                           job of an earlier call keeps its own copy), then run cmd there with setsid, its output
#                           in /root/bg/NAME.log, "BG_DONE rc=N" appended when it ends;
#                           KEEP_GPU_PROCS=1 is exported so that a later part does not kill its GPU processes
#   bg_wait NAME... LIMIT   wait until every NAME is done or LIMIT seconds of this call have passed (SECONDS)
#   bg_collect              copy /root/bg/*.log and every JSON under /root/bg to $R (finish brings them back)
#
# Several jobs started in one call run one after another when chained in one command:
#   bg_start gpu-tests bash -c 'python -m pytest -m gpu ...; python benchmarks/bench_spec_gpu.py ...'
# A later call of the same lease (within the 30 s warm window) sources gpu_session.sh again and calls bg_wait.
BG=/root/bg
bg_start() {
  local name=$1; shift
  mkdir -p "$BG"
  local tree=/root/tg.$$
  if [ ! -d "$tree" ]; then
    mkdir -p "$tree" && tar cf - --exclude=./.gpu_gguf --exclude=./.whl --exclude=./.git . | tar xf - -C "$tree"
  fi
  export KEEP_GPU_PROCS=1
  : > "$BG/$name.log"  # (there before bg_start returns: bg_wait takes a job without a log for one never started)
  # (the subshell's own output closed first: otherwise a caller that pipes this call's output (`... | tail`) waits
  # for the job, and the device call runs into its limit with nothing printed)
  (exec > /dev/null 2>&1; cd "$tree" && PYTHONPATH=.:benchmarks:/tmp/site PYTHONUNBUFFERED=1 setsid nohup bash -c \
    '"$@"; echo "BG_DONE rc=$?"' _ "$@" > "$BG/$name.log" 2>&1 < /dev/null &)
  echo "== started $name in the background: $*"
}
# (a job never started in this lease, no log of it, counts as done: waiting for it would only spend the call)
bg_done() { [ ! -e "$BG/$1.log" ] || grep -q "^BG_DONE" "$BG/$1.log" 2>/dev/null; }
bg_wait() {
  local limit=${*: -1} names=("${@:1:$#-1}") name pending
  while [ "$SECONDS" -lt "$limit" ]; do
    pending=0
    for name in "${names[@]}"; do bg_done "$name" || pending=1; done
    [ "$pending" = 0 ] && break
    sleep 3
  done
  for name in "${names[@]}"; do
    if [ ! -e "$BG/$name.log" ]; then echo "== $name: never started"; continue; fi
    echo "== $name: $(grep '^BG_DONE' "$BG/$name.log" 2>/dev/null || echo "still running after $SECONDS s")"
    grep -E '^\{|passed|failed|error|FAILED|SKIPPED' "$BG/$name.log" 2>/dev/null | tail -"${TAILN:-8}" | cut -c1-400
  done
}
bg_collect() {
  mkdir -p "$R/bg"
  cp "$BG"/*.log "$R/bg/" 2>/dev/null
  # (the results a job wrote, not the per-run JSONs of twogrid bench under a bench/ folder: a matrix writes
  # hundreds, and a call brings back 8 files of at most 16 MiB)
  find "$BG" -name '*.json' -not -path '*/bench/*' -exec cp {} "$R/bg/" \; 2>/dev/null
  true
}
