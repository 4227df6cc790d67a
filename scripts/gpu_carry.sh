#!/usr/bin/env bash
# Builds, on this (CPU) machine, the ignored folders that a GPU call carries (scripts/gpu_check.sh reads them):
#   .whl/       wheels missing on the device machine (Python 3.12, x86-64), installed there by scripts/gpu_env.sh:
#               the versions installed here of msgspec, pyzmq, gguf, aiohttp-cors, xgrammar, openai, jsonschema,
#               py-spy and their needs
#   .gpu_data/  sharegpt.json (the ShareGPT prompts) and smollm2-tokenizer/ (SmolLM2's tokenizer as a directory)
#   .gpu_gguf/  the default model's GGUF (98 MB) in three pieces: p00 of FIRST_MIB MiB (default 18: it travels with
#               .whl and .gpu_data), p01 and p02 the rest in halves (~38 MiB). A call carries at most 64 MiB with the
#               tracked tree (~22 MiB), so the pieces travel over three calls made within the machine's 30 s warm
#               window, each copying its piece out of the tree (to /root), the last joining them into the cache:
#               scripts/gpu_chain.sh 1|2|3 does it, checked against the pinned sha256
# Run from the repository root after `pip install -e '.[test]'`:  bash scripts/gpu_carry.sh [FIRST_MIB]
set -euo pipefail
first_mib=${1:-18}
wheels=(msgspec pyzmq gguf aiohttp-cors xgrammar apache-tvm-ffi openai httpx2 httpcore2 truststore jiter pydantic
        pydantic-core annotated-types typing-inspection sniffio distro
        jsonschema jsonschema-specifications referencing rpds-py  # (jsonschema: the served structured-output test)
        py-spy)  # (scripts/gpu_spy.sh's profiler; pip install py-spy here first)
mkdir -p .whl .gpu_data .gpu_gguf
for name in "${wheels[@]}"; do
  version=$(python3 -m pip show "$name" 2>/dev/null | sed -n "s/^Version: //p" || true)
  [[ -n "$version" ]] || { echo "skip $name: not installed here"; continue; }
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    --platform any -d .whl "$name==$version"
done
python3 - <<'PY'
import json, os, shutil
from tests.textdata import SHAREGPT
from models.default_model import default_model_path
from models.text import load_tokenizer
shutil.copy(SHAREGPT, ".gpu_data/sharegpt.json")
gguf = default_model_path()
tok = load_tokenizer(gguf)
out = ".gpu_data/smollm2-tokenizer"
os.makedirs(out, exist_ok=True)
tok.backend.save(os.path.join(out, "tokenizer.json"))
with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as fh:
    json.dump({**tok.special_tokens, "chat_template": tok.chat_template,
               "tokenizer_class": "PreTrainedTokenizerFast"}, fh)
print(gguf)
PY
gguf=$(python3 -c "from models.default_model import default_model_path; print(default_model_path())")
rm -f .gpu_gguf/p*
python3 - "$gguf" "$first_mib" <<'PY'
import sys
# (in Python: `tail | head -c` under pipefail ended the script on tail's SIGPIPE before the last piece was cut)
data = open(sys.argv[1], "rb").read()
first = int(sys.argv[2]) * 2**20
half = (len(data) - first + 1) // 2
for name, piece in (("p00", data[:first]), ("p01", data[first:first + half]), ("p02", data[first + half:])):
    with open(f".gpu_gguf/{name}", "wb") as fh:
        fh.write(piece)
PY
du -sh .whl .gpu_data .gpu_gguf/*
