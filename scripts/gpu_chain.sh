#!/usr/bin/env bash
# The default model's GGUF onto the device machine over three calls made within its 30 s warm window (a call
# carries at most 64 MiB; scripts/gpu_carry.sh cut the GGUF into .gpu_gguf/p00-p02). Run it first in
# each call's command, from the repository root:
#   call 1: carry [".whl", ".gpu_data", ".gpu_gguf/p00"]   bash scripts/gpu_chain.sh 1; <bench-moe work>
#   call 2: carry [".gpu_gguf/p01"]                         bash scripts/gpu_chain.sh 2; <bench-moe work>
#   call 3: carry [".gpu_gguf/p02"]                         bash scripts/gpu_chain.sh 3 && <default-model work>
# Call 3 joins the pieces into $TWOGRID_CACHE (default ~/.cache/twogrid) and checks the file's sha256 against the
# pin in models/default_model.py (exit 1 if a piece is missing or the bytes differ).
set -euo pipefail
case "${1:-}" in
  1) cp .gpu_gguf/p00 /root/ ;;
  2) cp .gpu_gguf/p01 /root/ ;;
  3) cp .gpu_gguf/p02 /root/
     cache="${TWOGRID_CACHE:-$HOME/.cache/twogrid}"
     mkdir -p "$cache"
     cat /root/p00 /root/p01 /root/p02 > "$cache/SmolLM2-135M-Instruct.Q4_1.gguf.part"
     PYTHONPATH=. python3 - "$cache/SmolLM2-135M-Instruct.Q4_1.gguf.part" <<'PY'
import hashlib, os, sys
from models.default_model import GGUF_SHA256
path = sys.argv[1]
digest = hashlib.sha256(open(path, "rb").read()).hexdigest()
if digest != GGUF_SHA256:
    sys.exit(f"{path}: sha256 {digest}, not the pinned {GGUF_SHA256}: a piece is missing or stale")
os.replace(path, path.removesuffix(".part"))
print("default model GGUF in place:", path.removesuffix(".part"))
PY
     ;;
  *) echo "usage: bash scripts/gpu_chain.sh 1|2|3" >&2; exit 2 ;;
esac
