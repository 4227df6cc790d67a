# Sourced by the GPU scripts on the device machine: the repository and benchmarks/ importable, unbuffered output,
# and the carried wheels (.whl: msgspec, pyzmq, gguf, missing there) installed into /tmp/site (a later call of the same
# lease, which cannot carry them beside a GGUF piece, finds them there).
export PYTHONPATH=.:benchmarks${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# a GPU test that skips here fails, naming why (tests/gpu_skips.py): a skipped test is not a passing test
export TWOGRID_GPU_NO_SKIPS=1
# the device's Python packages carry no bytecode, and none was written: every process of a server compiled ~1,000
# modules (torch's, transformers') from source, 2.5 s of each start-up (a profile of 73de5af's). A pip install
# compiles it; the runs keep theirs under one prefix, as a user's installed environment has it (the first start of a
# call compiles what changed)
export PYTHONPYCACHEPREFIX=/root/.cache/pycache
unset PYTHONDONTWRITEBYTECODE
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
elif [ -d /tmp/site ]; then
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
