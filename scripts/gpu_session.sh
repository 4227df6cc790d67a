# Sourced first by a device call's command, from the repository root (after scripts/gpu_chain.sh where the default
# model is needed):  source scripts/gpu_session.sh <commit>; part NAME LIMIT cmd...; ...; finish
# - the carried wheels installed (scripts/gpu_env.sh), TWOGRID_COMMIT set (the device's .git can be older than the
#   tree it ran);
# - part: one step under its own time limit, its output in $OUT/r/NAME.log, the servers and GPU processes it left
#   killed, its exit code, seconds and result lines printed (TAILN=k: the last k; a step cut off keeps what it
#   saved); pytest under it: pass -o addopts= so that its summary line prints (pyproject's -q plus yours hides it);
# - finish: every JSON in $OUT/r copied to $OUT and the whole folder in $OUT/rest.tgz (a call brings back 8 files);
# - work longer than a call (tests, then benchmarks, across the calls of one lease): scripts/gpu_background.sh;
# - D, T: the ShareGPT prompts and SmolLM2's tokenizer in .gpu_data (scripts/gpu_carry.sh); SMOL: the default
#   model's shape as a ModelConfig JSON (random weights: profile_spec_step --model "$SMOL" --fixed-acceptance A).
set -uo pipefail
source scripts/gpu_env.sh
export TWOGRID_COMMIT=${1:?usage: source scripts/gpu_session.sh COMMIT}
# (a commit id, this machine's `git log -1 --format=%h`: not HEAD nor `git log` there, whose .git lags the tree)
[[ $TWOGRID_COMMIT =~ ^[0-9a-f]{7,40}$ ]] || echo "warning: TWOGRID_COMMIT=$TWOGRID_COMMIT is not a commit id; the results will record it as given"
R=$OUT/r; mkdir -p "$R"
# GPU: the card in file names (h200 or h100: the device tool lends either)
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -qi h100 && echo h100 || echo h200)
# kill_gpu_procs: the GPU processes this work started (run from this tree or a background copy of it, /root/tg.*),
# not any other process that holds the GPU
kill_gpu_procs() {
  local pid cwd
  for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do
    cwd=$(readlink "/proc/$pid/cwd" 2>/dev/null) || continue
    case "$cwd" in "$PWD"*|/root/tg.*) kill -9 "$pid" 2>/dev/null ;; esac
  done
}
part() {
  local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@" > "$R/$name.log" 2>&1; local rc=$?
  pkill -f "[d]ispatcher serve"; pkill -f "[p]y-spy"; sleep 1
  # (a worker whose server was killed with its step can hold the GPU's memory a while: the next part's server
  # would find the device full)
  # (KEEP_GPU_PROCS=1: none killed, for a trainer started with setsid that outlives this call)
  [ -n "${KEEP_GPU_PROCS:-}" ] || kill_gpu_procs
  echo "== $name rc=$rc $((SECONDS - t0)) s"
  grep -E '^\{|passed|failed|error' "$R/$name.log" | tail -"${TAILN:-8}" | cut -c1-900
}
finish() { cp "$R"/*.json "$OUT"/ 2>/dev/null; tar czf "$OUT/rest.tgz" -C "$R" .; ls -la "$OUT" | tail -n +2; }
D=.gpu_data/sharegpt.json; T=.gpu_data/smollm2-tokenizer
SMOL='{"vocab_size": 49152, "hidden_size": 576, "num_layers": 30, "num_heads": 9, "num_kv_heads": 3, "head_dim": 64, "intermediate_size": 1536, "tie_word_embeddings": true, "rope_theta": 100000.0, "max_position_embeddings": 8192, "eos_token_ids": [2]}'
