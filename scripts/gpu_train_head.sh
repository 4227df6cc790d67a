#!/usr/bin/env bash
# The default model's EAGLE-3 head trained further on the device machine, then served beside the shipped one: five
# calls, each made within the machine's 30 s warm window (the trainer outlives its call), each from the repository
# root with C set to the commit:
#   call 1: carry [".whl", ".gpu_data", ".gpu_gguf/p00", ".gpu_tools"]   C=<commit> bash scripts/gpu_train_head.sh 1
#   call 2: carry [".gpu_gguf/p01", ".gpu_tools"]                          ... 2
#   call 3: carry [".gpu_gguf/p02", ".gpu_tools"]                          ... 3   (GGUF joined; the default
#           model's GPU tests run, or with TRAINSTEP=1 a training step timed both ways; the trainer started)
#   call 4: carry [".gpu_tools"]                                           ... 4   (waits for it; head, JSON, data back)
#   call 5: carry [".gpu_tools"]                                           ... 5   (both heads served, 1 and 16 streams)
# A machine gone cold after call 4 (a later call answers warm: false) has lost the GGUF and the head: put the head
# call 4 brought back into an ignored folder of the tree, carry it (and the GGUF's pieces, scripts/gpu_chain.sh 1-3)
# over again, copy it out of the tree, and run call 5 with HEAD_DIR set to that copy.
# .gpu_tools holds sharegpt.json (scripts/gpu_carry.sh puts it in .gpu_data, which call 3 does not carry).
# TRAIN_S (480), LR (3e-4) and SEED (2) set the run: the shipped head trained on over answers sampled anew (its two
# runs used seeds 0 and 1: the same seed would regenerate data it was trained on). Ship the new head only where it
# beats the shipped one, paired round by round (bench_spec_gpu's vs_default_head).
set -uo pipefail
OUTDIR=/root/e3n
case "${1:-}" in
  1) bash scripts/gpu_chain.sh 1 ;;
  2) bash scripts/gpu_chain.sh 2 ;;
  3) mkdir -p .gpu_data && cp .gpu_tools/sharegpt.json .gpu_data/ && bash scripts/gpu_chain.sh 3 || exit 1
     source scripts/gpu_session.sh "${C:?set C to the commit}"
     # the default model's GPU tests and its drafters' (tests/test_default_model_drafters.py runs on the device
     # where there is one); TRAINSTEP=1 times a training step both ways instead (bench_train_step.py)
     if [ -n "${TRAINSTEP:-}" ]; then
       part trainstep 150 python benchmarks/bench_train_step.py --device cuda --out "$R/train_step_h200.json"
     else
       dm=tests/test_default_model.py
       TAILN=14 part gputests 240 python -m pytest -o addopts= -q -rs -p no:cacheprovider \
         tests/test_default_model_drafters.py $dm::test_default_model_on_the_gpu_answers_like_the_cpu \
         $dm::test_the_default_model_drafting_for_itself_on_the_gpu
     fi
     finish
     export KEEP_GPU_PROCS=1
     mkdir -p "$OUTDIR" && rm -rf /root/e3src && cp -r . /root/e3src && cd /root/e3src || exit 1
     setsid nohup python scripts/train_eagle3.py --data .gpu_data/sharegpt.json --out "$OUTDIR" --samples 20 \
       --temperatures 0.3,0.5,0.7,0.9 --follow-ups 3 --follow-up-samples 4 --validation-prompts 25 \
       --validate-seconds 60 --train-seconds "${TRAIN_S:-480}" --lr "${LR:-3e-4}" \
       --init-head models/heads/smollm2-135m-instruct-eagle3 --seed "${SEED:-2}" --kv-cache-gib 12 \
       --save-data "$OUTDIR/seqs.npz" --eval-k 3,5 > "$OUTDIR.log" 2>&1 < /dev/null &
     for _ in $(seq 1 80); do sleep 5; [ -f "$OUTDIR/train_eagle3.json" ] && break; done
     tail -5 "$OUTDIR.log"; nvidia-smi --query-gpu=memory.used --format=csv ;;
  4) for _ in $(seq 1 110); do grep -q '"total_seconds"' "$OUTDIR/train_eagle3.json" 2>/dev/null && break; sleep 5; done
     mkdir -p "$OUT/e3n" && cp -r "$OUTDIR/head" "$OUTDIR/train_eagle3.json" "$OUTDIR.log" "$OUT/e3n/" 2>/dev/null
     cp "$OUTDIR/seqs.npz" "$OUT/" 2>/dev/null
     tail -12 "$OUTDIR.log"; ls -la "$OUT" "$OUT/e3n" ;;
  5) head=${HEAD_DIR:-$OUTDIR/head}
     [ -f "$head/model.safetensors" ] || { echo "no head in $head: the machine went cold after call 4?" >&2; exit 1; }
     source scripts/gpu_session.sh "${C:?set C to the commit}"
     part heads 560 python benchmarks/bench_spec_gpu.py --data "$D" --methods \
       "none,eagle3:3,eagle3:3@$head,eagle3:5,eagle3:5@$head" --policies separate --concurrency 1,16 \
       --waves 4 --min-prompts 16 --together --rounds 3 --kv-gib 8 --out "$R/spec_heads_h200.json"
     finish ;;
  *) echo "usage: C=<commit> bash scripts/gpu_train_head.sh 1|2|3|4|5" >&2; exit 2 ;;
esac
