import os

# One OpenMP thread per process (unless set): the suite runs servers beside itself (front ends, an engine, a worker
# each), and on a 2-core machine two threads a process spin-wait for a core another process holds; a step of the
# float32 default model took ten times as long (27 s against 2.6 s for three 16-token chats, and an engine test file
# 97 s against 21 s) under the load of a second test run. Set before torch is imported, so that torch reads it, and
# inherited by every process a test starts.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import gpu_skips  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings

# CI runs the same examples every time (a submission must not fail on a newly drawn example); set
# HYPOTHESIS_PROFILE=explore (or run locally) to draw new ones.
settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "explore"))

try:
    import torch

    HAS_CUDA = torch.cuda.is_available()
except ImportError:  # the planning and scheduling tests need no torch
    HAS_CUDA = False


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""Triton's interpreter runs the kernels on the CPU (tests/test_kernels_interpreted.py sets it for a subprocess)."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if gpu_skips.enabled(HAS_CUDA):
        gpu_skips.skip_as_failure(outcome.get_result(), item.keywords)


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_kernels = pytest.mark.skip(reason="needs a CUDA GPU or TRITON_INTERPRET=1 (tests/test_kernels_interpreted.py)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
        elif "kernels" in item.keywords and not INTERPRETED:
            item.add_marker(skip_kernels)


@pytest.fixture(scope="session")
def texts() -> list[str]:
    """The 500 ShareGPT prompts, and two strings of four-byte UTF-8 characters (which the prompts lack)."""
    import json

    from textdata import SHAREGPT

    with open(SHAREGPT, encoding="utf-8") as fh:
        data = json.load(fh)
    out = [c["value"] for d in data for c in d["conversations"]]
    assert len(out) == 500 and sum(any(ord(ch) > 0x3000 for ch in t) for t in out) >= 10  # Korean, Chinese, ...
    return out + ["Party \U0001f389\U0001f389 time \U0001f469\u200d\U0001f4bb flag \U0001f1f0\U0001f1f7 and "
                  "e\u0301 or \U0001d518\U0001d52b\U0001d526", "\U0001f642"]


@pytest.fixture(scope="session")
def bpe(texts, tmp_path_factory):
    """A byte-level BPE trained on the prompts (Qwen2's split), saved as a Hugging Face tokenizer directory
    (tokenizer.json and a tokenizer_config.json with a ChatML template)."""
    from textdata import train_bpe

    return train_bpe(texts[:300], str(tmp_path_factory.mktemp("bpe")), vocab_size=700)



@pytest.fixture(scope="session")
def tiny_llama(bpe, tmp_path_factory) -> str:
    """A tiny random Llama checkpoint directory (transformers' save_pretrained) with the ``bpe`` tokenizer and its
    ChatML template: a model with text and a chat template that loads and runs in a second on the CPU."""
    from textdata import write_tiny_llama

    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    return write_tiny_llama(bpe, tmp_path_factory.mktemp("tiny_llm"))


@pytest.fixture(scope="module")
def gguf_read_once():
    """transformers parses a GGUF file's whole header (a numpy view per metadata string) each time it loads the
    tokenizer, the config and the weights: about 20 s for each on Gemma 3's 262K-token vocabulary on a 2-core CPU.
    With this fixture a module's loads share one ``gguf.GGUFReader`` per file (read-only, memory-mapped): the same
    tokenizer and model, read once."""
    gguf = pytest.importorskip("gguf")
    real, readers = gguf.GGUFReader, {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = real(path, mode)
        return readers[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", reader)
        yield


def _interpreted_device_calls_patch_nothing_twice() -> None:
    """Under TRITON_INTERPRET=1, Triton patches triton.language's builtins when a kernel launches (restored after
    it) and again at every call of a @triton.jit helper from inside the kernel (``InterpretedFunction.__call__``,
    never restored there), each time walking the language modules with ``inspect.getmembers``: a third of the
    interpreted MoE tests' time. Here a helper's call during a launch that has patched its language modules already
    patches nothing: a module stays patched until the launch ends, so the interpreter runs in the same state.
    Without those internals (another Triton) nothing changes."""
    import inspect

    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    real_patch = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if real_patch is None or executor is None or not callable(getattr(interpreter, "_LangPatchScope", None)):
        return
    launches: list[set[int]] = []  # for each running launch, the language modules patched since it began
    real_launch = executor.__call__

    def launch(self, *args, **kwargs):
        launches.append(set())
        try:
            return real_launch(self, *args, **kwargs)
        finally:
            launches.pop()

    modules: dict = {}  # a function's language modules (those among its module's globals)

    def patch_lang(fn):
        mods = modules.get(fn)
        if mods is None:
            mods = modules[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                           if inspect.ismodule(v) and v in (tl, tl.core))
        if launches and mods <= launches[-1]:
            return interpreter._LangPatchScope()  # (patched already: nothing to restore either)
        scope = real_patch(fn)
        if launches:
            launches[-1] |= mods
        return scope

    executor.__call__ = launch
    interpreter._patch_lang = patch_lang


if INTERPRETED:
    _interpreted_device_calls_patch_nothing_twice()
