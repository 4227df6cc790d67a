# Sourced by the GPU scripts on the device machine: the repository and benchmarks/ importable, unbuffered output,
# and the carried wheels (.whl: msgspec, pyzmq, gguf, missing there) installed into /tmp/site (a later call of the same
# lease, which cannot carry them beside a GGUF piece, finds them there).
export PYTHONPATH=.:benchmarks${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# a GPU test that skips here fails, naming why (tests/gpu_skips.py): a skipped test is not a passing test
export TWOGRID_GPU_NO_SKIPS=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
elif [ -d /tmp/site ]; then
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
