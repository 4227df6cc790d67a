#!/usr/bin/env bash
# Issue 33's serving during delayed capture with stand-ins and the rest after a unit (capture.StandIns,
# REST_PER_UNIT), against an earlier commit's servers in the same lease (BASE, default 2fabc49: every target forward
# without its graph eager, a unit in every gap), in four calls made within the machine's 30 s warm window, each from
# the repository root with C set to the commit. Before call 1, here:
#   git archive ${BASE:-2fabc49} dispatcher models scheduler ':(exclude)models/heads' | gzip > .gpu_tools/base.tgz
# (the shipped heads are copied from this tree: call 1 carries 63 of its 64 MiB)
#   call 1: carry [".whl", ".gpu_data", ".gpu_gguf/p00", ".gpu_tools"]   C=<commit> bash scripts/gpu_stand_ins.sh 1
#           in the background: the delayed-capture GPU tests, then bench-moe during capture (both workloads)
#   call 2: carry [".gpu_gguf/p01", ".gpu_tools"]                          ... 2   (waits)
#   call 3: carry [".gpu_gguf/p02", ".gpu_tools"]                          ... 3   (GGUF joined; in the background,
#           once call 1's job is done: the default model during capture, this commit's servers then BASE's, then
#           after capture with eagle3 K = 7, two alternated rounds)
#   call 4: carry [".gpu_tools"]                                           ... 4   (waits; repeat while it runs)
# Results: startup_capture_*_$GPU.json (this commit's: moe, default; BASE's: default_base) and si_rest.tgz (logs,
# the during-capture step traces).
set -uo pipefail
results() {
  mkdir -p "$OUT/x"
  cp /root/bg/si/*.json /root/bg/si/base/*.json "$OUT/x/" 2>/dev/null
  (cd /root/bg && tar czf "$OUT/x/si_rest.tgz" --exclude='*.json' si.log si1.log si 2>/dev/null)
  ls -la "$OUT/x"
}
capture() {  # OUT_NAME, then bench_startup_gpu.py's flags
  local name=$1; shift
  echo "python benchmarks/bench_startup_gpu.py --part capture --data $D --tokenizer $T --out /root/bg/si/$name $*; "
}
case "${1:-}" in
  1) bash scripts/gpu_chain.sh 1
     source scripts/gpu_session.sh "${C:?set C to the commit}"; source scripts/gpu_background.sh
     mkdir -p /root/bg/si /root/base && tar xzf .gpu_tools/base.tgz -C /root/base && cp -r models/heads /root/base/models/
     runs="python -m pytest -o addopts= -q -m gpu tests/test_delayed_capture.py -k 'cuda_graphs or serve_on_cuda or stand_in' "
     runs+="> /root/bg/si/gpu_tests.log 2>&1; tail -3 /root/bg/si/gpu_tests.log; "
     runs+=$(capture "startup_capture_moe_$GPU.json" --models bench-moe --no-after)
     bg_start si1 bash -c "$runs"
     bg_wait si1 "${LIM:-200}" ;;
  2) bash scripts/gpu_chain.sh 2
     source scripts/gpu_session.sh "${C:?set C to the commit}"; source scripts/gpu_background.sh
     bg_wait si1 "${LIM:-300}"; results ;;
  3) bash scripts/gpu_chain.sh 3 || exit 1
     source scripts/gpu_session.sh "${C:?set C to the commit}"; source scripts/gpu_background.sh
     runs="for i in \$(seq 600); do [ -e /root/bg/si1.log ] && ! grep -q '^BG_DONE' /root/bg/si1.log || break; sleep 2; done; "
     runs+=$(capture "startup_capture_default_$GPU.json" --models default --no-after)
     runs+="mkdir -p /root/bg/si/base; "  # (its own folder: the step traces are named by model and workload)
     runs+=$(capture "base/startup_capture_default_base_$GPU.json" --models default --no-after --server-tree /root/base)
     runs+=$(capture "startup_capture_default_$GPU.json" --models default --workloads eagle3-k7 --rounds 2 --no-during)
     bg_start si bash -c "$runs"
     bg_wait si "${LIM:-560}"; results ;;
  4) source scripts/gpu_session.sh "${C:?set C to the commit}"; source scripts/gpu_background.sh
     bg_wait si "${LIM:-560}"; results
     if bg_done si; then pkill -f '[b]ench_startup_gpu'; pkill -f '[d]ispatcher serve'; sleep 1; kill_gpu_procs; fi ;;
  *) echo "usage: C=<commit> bash scripts/gpu_stand_ins.sh 1|2|3|4" >&2; exit 2 ;;
esac
