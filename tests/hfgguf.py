"""transformers' own reading of a GGUF, the reference the real-model tests compare against, converted once and kept
in the cache: its tokenizer (``save_pretrained``) and its model dequantized to float32 (safetensors, with the config
and generation config it built), under ``${TWOGRID_CACHE:-~/.cache/twogrid}/hf_from_gguf/``, keyed by the GGUF's
sha256 and the versions of transformers, tokenizers, gguf and torch that converted it.

Reading a GGUF costs transformers a parse of the file's whole header for the tokenizer and again for the model
(about 80 s for Gemma 3 270M's 262K-token vocabulary on a 2-core CPU, 30 s for SmolLM2); the saved conversion loads
in a few seconds. A later run reads back what transformers built from the GGUF, tensor for tensor: the same
weights, config and generation config, and the same tokenizer.json (its normalizer, pre-tokenizer, post-processor,
vocabulary and merges), so that the tokens it encodes and the greedy tokens the model generates are those of
loading the GGUF again. A new version of any of those packages converts again."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile

log = logging.getLogger("twogrid.tests")


@functools.cache
def _sha256(path: str) -> str:
    from models.default_model import file_sha256

    return file_sha256(path)


def _folder(gguf: str, part: str) -> tuple[str, dict]:
    """The cache folder of ``part`` ("tokenizer" or "model") of transformers' conversion of ``gguf``, and its key."""
    from importlib.metadata import version

    from models.default_model import cache_dir

    key = {"gguf_sha256": _sha256(os.path.realpath(gguf)), "part": part,
           **{package: version(package) for package in ("transformers", "tokenizers", "gguf", "torch")}}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    name = f"{os.path.basename(gguf).removesuffix('.gguf')}-{part}-{digest}"
    return os.path.join(cache_dir(), "hf_from_gguf", name), key


def _keep(folder: str, key: dict, save) -> None:
    """``save(directory)`` into a temporary directory beside ``folder``, renamed into place when whole (a reader
    never sees a partial conversion); a failure to save is logged and leaves the cache as it was."""
    parent = os.path.dirname(folder)
    tmp = None
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=os.path.basename(folder) + ".", suffix=".part", dir=parent)
        save(tmp)
        with open(os.path.join(tmp, "key.json"), "w", encoding="utf-8") as fh:
            json.dump(key, fh, indent=1)
        os.rename(tmp, folder)
        tmp = None
        log.info("transformers' conversion saved to %s", folder)
    except OSError as exc:  # (another run saved it first: the rename finds the folder there)
        if not os.path.isdir(folder):
            log.warning("cannot keep transformers' conversion in %s (%s)", folder, exc)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def hf_tokenizer_from_gguf(gguf: str):
    """transformers' tokenizer of ``gguf`` (``AutoTokenizer.from_pretrained(folder, gguf_file=name)``), from the
    cache after the first time."""
    import transformers

    folder, key = _folder(gguf, "tokenizer")
    if os.path.isfile(os.path.join(folder, "key.json")):
        return transformers.AutoTokenizer.from_pretrained(folder)
    tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    _keep(folder, key, tok.save_pretrained)
    return tok


def hf_model_from_gguf(gguf: str):
    """transformers' model of ``gguf`` in float32, in eval mode
    (``AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)``), from the cache after the
    first time."""
    import torch
    import transformers

    folder, key = _folder(gguf, "model")
    if os.path.isfile(os.path.join(folder, "key.json")):
        return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                                              dtype=torch.float32).eval()

    def save(path: str) -> None:
        # save_pretrained refuses a model loaded from a GGUF ("quantized with gguf", though dequantized): the
        # weights as safetensors and the config without its quantization_config (the GGUF file it came from)
        import copy

        import safetensors.torch

        config = copy.deepcopy(model.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(path)
        model.generation_config.save_pretrained(path)
        safetensors.torch.save_model(model, os.path.join(path, "model.safetensors"))

    _keep(folder, key, save)
    return model
