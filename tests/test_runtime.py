"""The graph runtime and worker: replayed (static, padded) output equals eager output for every kind, padded
rows never touch real KV blocks, and greedy generation through the graph path equals eager generation.
CPU tests run the static-shape backend; GPU tests (marked gpu) capture and replay real CUDA graphs."""

from __future__ import annotations

import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dispatcher.plan.config import resolve  # noqa: E402
from dispatcher.plan.dispatch import dispatchers_for_plan  # noqa: E402
from dispatcher.engine.engine_core import EngineArgs, EngineCore  # noqa: E402
from dispatcher.engine.trace import read_trace  # noqa: E402
from dispatcher.plan.capture_plan import build_plan  # noqa: E402
from dispatcher.runtime.graphs import GraphRuntime, StepInputs  # noqa: E402
from models.attention import allocate_kv_cache  # noqa: E402
from models.config import preset  # noqa: E402
from models.fused import programmatic_launch  # noqa: E402
from models.transformer import build_model  # noqa: E402
from scheduler.request import SamplingParams  # noqa: E402

BLOCK = 8


def make_runtime(model_name, device, dtype, cc, spec=None, max_num_seqs=16, mnbt=256, num_blocks=128, graphs=True,
                 proposes=False):
    cfg = resolve(cc, spec, platform="sm100", max_num_seqs=max_num_seqs, max_num_batched_tokens=mnbt)
    plan = build_plan(cfg)
    mcfg = preset(model_name)
    model = build_model(mcfg, device, dtype, seed=1)
    kv = allocate_kv_cache(mcfg.num_layers, num_blocks, BLOCK, mcfg.num_kv_heads, mcfg.head_dim, dtype, device)
    rt = GraphRuntime(model, kv, plan.for_runner("target"), max_num_tokens=mnbt, max_num_reqs=max_num_seqs,
                      max_blocks_per_seq=16, use_cuda_graphs=graphs, proposes=proposes)
    rt.capture(progress=False)
    return cfg, rt, dispatchers_for_plan(plan)["target"]


def decode_batch(rt, num_reqs, q, ctx, seed=0):
    """num_reqs requests in slots 0.., each with ctx tokens already cached, verifying q - 1 drafts."""
    rng = np.random.default_rng(seed)
    bt = np.arange(num_reqs * 16).reshape(num_reqs, 16) % 120
    rows, cols = np.nonzero(np.ones_like(bt))
    rt.update_block_table(rows, cols, bt[rows, cols])
    positions = (np.arange(q)[None, :] + ctx).repeat(num_reqs, 0).ravel()
    reqs = np.repeat(np.arange(num_reqs), q)
    slots = bt[reqs, positions // BLOCK] * BLOCK + positions % BLOCK
    ids = rng.integers(3, 500, size=num_reqs * q)
    return np.stack([ids, positions, slots, reqs]).astype(np.int64)


def run_both(rt, dispatcher, host, is_decode, q):
    """The descriptor's path (replay or static) vs eager on the real rows, from the same KV state."""
    n = host.shape[1]
    num_reqs = len(np.unique(host[3]))
    desc = dispatcher.dispatch(n, num_reqs, q, is_decode)
    saved = [c.clone() for c in rt.kv_caches]
    replayed = rt.execute(desc, StepInputs.from_host(host, rt.device)).clone()
    for c, s in zip(rt.kv_caches, saved):
        c.copy_(s)
    eager = rt.execute(desc._replace(mode="NONE", graph=None), StepInputs.from_host(host, rt.device)).clone()
    return desc, replayed, eager


@pytest.mark.parametrize("full_mixed", [0, 16], ids=["piecewise-mixed", "full-mixed"])
@pytest.mark.parametrize("model_name", ["tiny-dense", "tiny-moe"])
def test_every_kind_matches_eager_on_cpu(model_name, full_mixed):
    """Every graph kind's replay gives the eager forward's rows: FULL decode, adaptive verification, PIECEWISE
    mixed, and with max_full_mixed_cudagraph_capture_tokens the mixed step in a FULL graph over tokens."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive_verification": True}
    cc = {"max_full_mixed_cudagraph_capture_tokens": full_mixed}
    cfg, rt, disp = make_runtime(model_name, "cpu", torch.float32, cc, spec)
    seen = set()
    for num_reqs, q, decode in [(3, 4, True), (7, 4, True), (5, 1, True), (2, 8, False), (13, 4, True)]:
        host = decode_batch(rt, num_reqs, q, ctx=11)
        desc, replayed, eager = run_both(rt, disp, host, decode, q)
        seen.add((desc.kind, desc.mode))
        torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)
    # a varlen decode (adaptive verification): requests with 1..4 tokens
    host = np.concatenate([decode_batch(rt, 1, q, ctx=9, seed=q)[:, :] + np.array([[0], [0], [0], [0]]) for q in (1, 3)], 1)
    host[3, 1:] = 1
    host[2, 1:] = host[2, 1:] + 16 * BLOCK
    desc, replayed, eager = run_both(rt, disp, host, True, 3)
    seen.add((desc.kind, desc.mode))
    torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)
    mixed = ("mixed", "FULL") if full_mixed else ("mixed", "PIECEWISE")
    assert {("uniform_decode", "FULL"), mixed, ("adaptive_verification", "FULL")} <= seen


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_proposing_runtime_takes_each_rows_greedy_token_and_probability_in_its_graph(device):
    """An EAGLE drafter's one-token steps take their drafts inside the graph: after a FULL replay, a PIECEWISE
    replay or an eager forward, ``proposals`` hold each real row's argmax of the logits of the hidden state the
    step returned and that token's softmax probability (stale rows of an earlier, wider step never show)."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    cfg, rt, disp = make_runtime("tiny-dense", device, dtype, {}, proposes=True)
    seen = set()
    for num_reqs, q, decode, eager in [(9, 1, True, False), (2, 8, False, False), (3, 1, True, True), (5, 1, True, False)]:
        host = decode_batch(rt, num_reqs, q, ctx=11, seed=num_reqs)
        desc = disp.dispatch(num_reqs * q, num_reqs, q, decode)
        if eager:
            desc = desc._replace(mode="NONE", graph=None)
        seen.add(desc.mode)
        hidden = rt.execute(desc, StepInputs.from_host(host, rt.device)).clone()
        ids, probs = rt.proposals(num_reqs * q)
        probs_ref = torch.softmax(rt.model.compute_logits(hidden).float(), dim=-1)
        assert torch.equal(ids, rt.model.compute_logits(hidden).argmax(dim=-1))
        torch.testing.assert_close(probs, probs_ref.gather(1, ids[:, None]).squeeze(1), rtol=1e-3, atol=1e-6)
    assert seen == {"FULL", "PIECEWISE", "NONE"}


def test_padded_rows_never_write_real_kv_blocks():
    cfg, rt, disp = make_runtime("tiny-dense", "cpu", torch.float32, {})
    host = decode_batch(rt, 7, 1, ctx=20)  # 7 requests pad to an 8-request graph
    desc = disp.dispatch(7, 7, 1, True)
    assert desc.mode == "FULL" and desc.num_reqs == 8
    before = [c.clone() for c in rt.kv_caches]
    rt.execute(desc, StepInputs.from_host(host, rt.device))
    written = {int(s) // BLOCK for s in host[2]}
    for c, b in zip(rt.kv_caches, before):
        changed = {i for i in range(c.shape[1]) if not torch.equal(c[:, i], b[:, i])}
        dummy = c.shape[1] - 1
        assert changed - {dummy} <= written, "a padded row wrote into a real block"
        assert dummy in changed, "padded rows go to the dummy block"


def random_prompts(n, seed, vocab=500):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(4, 60))] for _ in range(n)]


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3},
                                  {"method": "ngram", "num_speculative_tokens": 3, "adaptive_verification": True}])
def test_greedy_generation_static_equals_eager_on_cpu(spec):
    prompts = random_prompts(24, 0, vocab=40)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    args = EngineArgs(preset("tiny-moe"), num_kv_blocks=400, block_size=BLOCK, max_model_len=128)
    graphs = EngineCore(resolve({}, spec, platform="sm100", max_num_seqs=16, max_num_batched_tokens=256), args)
    plain = {k: v for k, v in (spec or {}).items() if k != "adaptive_verification"} or None  # greedy: same tokens
    eager = EngineCore(resolve({"cudagraph_mode": "NONE"}, plain, platform="sm100", max_num_seqs=16,
                               max_num_batched_tokens=256), args)
    assert graphs.generate(prompts, params) == eager.generate(prompts, params)


# ---------------------------------------------------------------------------------------------------------------
# GPU: real CUDA graphs
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("model_name", ["tiny-dense", "tiny-moe"])
def test_replay_is_bitwise_equal_to_static_eager_on_gpu(model_name):
    """Same kernels on the same padded shapes: CUDA graph replay equals running the closures eagerly. The graphs
    launch their Triton kernels programmatically (PDL) where the GPU has it, the eager runs never do: a kernel
    that read its inputs before waiting for the kernel before it would race, and differ here."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive_verification": True}
    _, graphs, disp = make_runtime(model_name, "cuda", torch.bfloat16, {}, spec)
    with programmatic_launch(False):
        _, static, _ = make_runtime(model_name, "cuda", torch.bfloat16, {}, spec, graphs=False)
    for num_reqs, q, decode in [(3, 4, True), (7, 4, True), (5, 1, True), (2, 8, False), (13, 4, True)]:
        host = decode_batch(graphs, num_reqs, q, ctx=11)
        decode_batch(static, num_reqs, q, ctx=11)
        desc = disp.dispatch(host.shape[1], num_reqs, q, decode)
        assert desc.mode != "NONE"
        a = graphs.execute(desc, StepInputs.from_host(host, graphs.device)).clone()
        with programmatic_launch(False):
            b = static.execute(desc, StepInputs.from_host(host, static.device)).clone()
        assert torch.equal(a, b), (desc, (a - b).abs().max())


@pytest.mark.gpu
@pytest.mark.parametrize("model_name", ["tiny-moe", "bench-moe"])
def test_greedy_generation_through_graphs_on_gpu(model_name):
    """50 prompts: graphs equal the padded static path token for token; against unpadded eager, by vLLM's
    convention (where outputs first diverge, each token is in the other run's top-5)."""
    prompts = random_prompts(50, 1, vocab=preset(model_name).vocab_size)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    cc = dict(platform="sm100", max_num_seqs=64, max_num_batched_tokens=1024)
    args = EngineArgs(preset(model_name), device="cuda", num_kv_blocks=2048, block_size=16, max_model_len=256)
    graphs = EngineCore(resolve({}, None, **cc), args).generate(prompts, params)
    static = EngineCore(resolve({}, None, **cc), EngineArgs(**{**vars(args), "use_cuda_graphs": False})).generate(
        prompts, params)
    assert graphs == static
    eager_engine = EngineCore(resolve({"cudagraph_mode": "NONE"}, None, **cc), args)
    eager = eager_engine.generate(prompts, params)
    exact = sum(a == b for a, b in zip(graphs, eager))
    for g, e, prompt in zip(graphs, eager, prompts):
        if g == e:
            continue
        i = next(j for j, (x, y) in enumerate(zip(g, e)) if x != y)
        logits = _next_logits(eager_engine, prompt + g[:i])
        top5 = set(torch.topk(logits, 5).indices.tolist())
        assert g[i] in top5 and e[i] in top5
    assert exact >= 25, f"only {exact} of 50 outputs identical to eager"


@pytest.mark.gpu
def test_serving_after_startup_compiles_no_triton_kernel(tmp_path):
    """Requests arriving one by one (prefill chunks beside decodes of every size: PIECEWISE steps whose attention
    runs eagerly with each step's own request count, query length and split count) meet no kernel variant that
    startup did not compile: no step of the trace waited for Triton (each such wait was ~0.5 s on an H200)."""
    spec = {"method": "eagle3", "num_speculative_tokens": 7}
    cfg = resolve({}, spec, platform="sm100", max_num_seqs=64, max_num_batched_tokens=2048)
    trace = tmp_path / "trace.jsonl"
    e = EngineCore(cfg, EngineArgs(preset("tiny-moe"), device="cuda", num_kv_blocks=4096, block_size=16,
                                   max_model_len=1024, fixed_acceptance=3.0, step_trace=str(trace)))
    assert e.worker.jit is not None and e.worker.jit.available
    rng = random.Random(0)
    vocab = preset("tiny-moe").vocab_size
    waiting = [[rng.randrange(3, vocab) for _ in range(rng.choice([3, 17, 40, 100, 300, 700]))] for _ in range(160)]
    for _ in range(rng.randint(1, 9)):
        e.add_request(waiting.pop(), SamplingParams(max_tokens=rng.randint(8, 64), ignore_eos=True))
    for outputs in e.run():
        for o in outputs:  # a closed loop of random size: new requests join running ones
            for _ in range(rng.randint(1, 2) if o.finished else 0):
                if waiting:
                    e.add_request(waiting.pop(), SamplingParams(max_tokens=rng.randint(8, 64), ignore_eos=True))
    e.close()
    records = read_trace(str(trace))
    assert sum(r["mode"] == "PIECEWISE" for r in records) > 20
    stalled = [r for r in records if r.get("jit_compiles")]
    assert not stalled, (f"{len(stalled)} steps waited for Triton compiles, the first: {stalled[0]}; the compiles, "
                         "newest last:\n" + "\n".join(e.worker.jit.history))


def _next_logits(engine, tokens):
    model = engine.worker.model
    from models.attention import allocate_kv_cache
    from models.attention_metadata import AttentionMetadata

    cfg = model.cfg
    n = len(tokens)
    kv = allocate_kv_cache(cfg.num_layers, -(-n // 16), 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, "cuda")
    bt = torch.arange(-(-n // 16), dtype=torch.int32, device="cuda")[None]
    pos = torch.arange(n, device="cuda")
    meta = AttentionMetadata.from_tokens(pos.clone(), torch.zeros(n, dtype=torch.int32, device="cuda"), pos.int(), bt)
    with torch.inference_mode():
        hidden = model(torch.tensor(tokens, device="cuda"), pos, kv, meta)
        return model.compute_logits(hidden[-1:])[0]


@pytest.mark.gpu
def test_capture_out_of_memory_is_a_clear_error():
    """Capture with almost no memory left: an error naming the kind, the size and the cap, not a crash."""
    import subprocess
    import sys

    code = r'''
import torch
from dispatcher.runtime.graphs import CaptureOOMError, shared_pool
from tests.test_runtime import make_runtime
cfg, rt, _ = make_runtime("bench-moe", "cuda", torch.bfloat16, {}, None, max_num_seqs=1024, mnbt=16384, graphs=False)
rt.cuda_graphs = True
shared_pool(rt.device)
total = torch.cuda.get_device_properties(0).total_memory
# room for the capture stream's library workspaces and the smallest graphs, not for the largest graph (~0.5 GiB)
torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + (256 << 20)) / total)
try:
    rt.capture(progress=False, estimate=False)
except CaptureOOMError as exc:
    print("CAUGHT", exc)
'''
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "CAUGHT out of GPU memory capturing the target piecewise graph for 8192 tokens" in proc.stdout, (
        proc.stdout + proc.stderr)[-3000:]
    assert "lower max_prefill_cudagraph_capture_tokens (largest piecewise size now 8192)" in proc.stdout


DRAFTER_SPECS = [
    {"method": "eagle3", "num_speculative_tokens": 3},
    {"method": "eagle3", "num_speculative_tokens": 3, "adaptive_verification": True},
    {"method": "eagle", "num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": [[1, 3], [9, 1]]},
    {"method": "mtp", "num_speculative_tokens": 1},
    {"method": "dflash", "num_speculative_tokens": 3},
    {"method": "dspark", "num_speculative_tokens": 4},
    {"method": "mtp_multi", "num_speculative_tokens": 2},
    {"method": "draft_model", "model": "tiny-dense", "num_speculative_tokens": 3},
]


@pytest.mark.parametrize("spec", DRAFTER_SPECS, ids=lambda s: "-".join(str(v) for v in s.values())[:40])
def test_model_drafters_keep_greedy_output_on_cpu(spec, tmp_path):
    """EAGLE-style and block drafters run through their runners' graphs (static backend on the CPU); drafts
    change how many tokens a step yields, never which."""
    prompts = random_prompts(20, 3, vocab=200)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    args = EngineArgs(preset("tiny-moe"), num_kv_blocks=400, block_size=BLOCK, max_model_len=128,
                      step_trace=str(tmp_path / "trace.jsonl"))
    engine = EngineCore(resolve({}, spec, platform="sm100", max_num_seqs=16, max_num_batched_tokens=256), args)
    eager = EngineCore(resolve({"cudagraph_mode": "NONE"}, None, platform="sm100", max_num_seqs=16,
                               max_num_batched_tokens=256), args)
    assert engine.generate(prompts, params) == eager.generate(prompts, params)
    assert engine.scheduler.stats.drafts_verified > 0
    one_token_steps = (spec["method"] in ("eagle", "eagle3", "mtp") and spec["num_speculative_tokens"] >= 2
                       or spec["method"] == "draft_model")
    assert len(engine.worker.draft_runtimes) == (2 if one_token_steps else 1)


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [DRAFTER_SPECS[0], DRAFTER_SPECS[1], DRAFTER_SPECS[4], DRAFTER_SPECS[7]],
                         ids=["eagle3", "eagle3-av", "dflash", "draft_model"])
def test_model_drafters_through_graphs_on_gpu(spec):
    """With drafter graphs captured, generation equals the padded static path token for token."""
    prompts = random_prompts(50, 2, vocab=preset("tiny-moe").vocab_size)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    cfg = resolve({}, spec, platform="sm100", max_num_seqs=64, max_num_batched_tokens=1024)
    args = EngineArgs(preset("tiny-moe"), device="cuda", num_kv_blocks=2048, block_size=16, max_model_len=256)
    graphs = EngineCore(cfg, args)
    assert all(k.graphs > 0 for k in graphs.capture_report.kinds)
    static = EngineCore(cfg, EngineArgs(**{**vars(args), "use_cuda_graphs": False}))
    assert graphs.generate(prompts, params) == static.generate(prompts, params)


def test_step_trace_shows_drafter_forwards(tmp_path):
    from dispatcher.engine.trace import read_trace

    trace = tmp_path / "t.jsonl"
    args = EngineArgs(preset("tiny-dense"), num_kv_blocks=200, block_size=BLOCK, max_model_len=128, step_trace=str(trace))
    engine = EngineCore(resolve({}, DRAFTER_SPECS[0], platform="sm100", max_num_seqs=16, max_num_batched_tokens=256),
                        args)
    engine.generate(random_prompts(4, 5), SamplingParams(max_tokens=6, ignore_eos=True))
    engine.trace.close()
    decode = [r for r in read_trace(str(trace)) if r["kind"] == "uniform_decode"]
    assert decode and all(len(r["draft"]) == 2 for r in decode)  # step 0 and the one-token steps
    assert decode[0]["draft"][0]["graph"][0] == "full_decode" and decode[0]["draft"][1]["graph"][:2] == ["full_decode", 1]


def test_max_model_len_beyond_the_model_positions_is_a_clear_error():
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings = 8192: lower max_model_len"):
        EngineCore(resolve({}, DRAFTER_SPECS[0], platform="sm100", max_num_seqs=4, max_num_batched_tokens=64),
                   EngineArgs(preset("tiny-dense"), num_kv_blocks=4096, block_size=8, max_model_len=8190))


def _record_drafts(engine, log):
    """Log every proposal as (request_id, position of its first draft) -> drafts, read from the worker's request
    state right after each step (the engine runs synchronously, so no later step has overwritten them)."""
    update = engine.update

    def wrapped(step, result):
        out = step.out
        k = out.num_new_drafts
        if k:
            first = out.first_sample_positions
            drafts = engine.worker.state.drafts[torch.from_numpy(out.slots), :k].tolist()
            for i, req in enumerate(out.requests):
                if out.samples[i]:
                    log[(req.request_id, int(first[i] + result.num_accepted[i] + 1))] = drafts[i]
        return update(step, result)

    engine.update = wrapped


@pytest.mark.parametrize("spec", [DRAFTER_SPECS[0], DRAFTER_SPECS[4], {**DRAFTER_SPECS[7], "model": "tiny-moe"}],
                         ids=["eagle3", "dflash", "draft_model"])
def test_drafts_do_not_depend_on_the_batch(spec):
    """A request's drafts depend on its own tokens only: proposals made with 8 requests batched (padded graphs,
    mixed prefill and decode steps) equal those made for each request alone. Catches KV rows, positions or
    features mixed between requests."""
    prompts = random_prompts(8, 7, vocab=300)
    params = SamplingParams(max_tokens=12, ignore_eos=True)

    def engine():
        cfg = resolve({}, spec, platform="sm100", max_num_seqs=16, max_num_batched_tokens=64)
        return EngineCore(cfg, EngineArgs(preset("tiny-dense"), num_kv_blocks=300, block_size=BLOCK, max_model_len=128,
                                          async_scheduling=False))

    batched, alone = {}, {}
    e = engine()
    _record_drafts(e, batched)
    e.generate(prompts, params)
    for i, prompt in enumerate(prompts):
        e = engine()
        log = {}
        _record_drafts(e, log)
        e.generate([prompt], params)
        alone.update({(f"req-{i}", pos): d for (_, pos), d in log.items()})
    assert len(batched) > 8 * 3
    assert batched == alone


def _one_step_at_a_time(self, step, plan, dev, inputs, features, tokens, accepted, first_pos, state) -> None:
    """EagleDrafter.propose as plainly as it can be written: each one-token step's inputs built on its own, the
    proposals taken from the head's logits outside the graph."""
    k, m, slots_s = step.num_new_drafts, plan.num_sampling, dev.sampling_slots
    last_row, _, last_pos = self._last(dev, tokens, accepted, first_pos)
    feature = self.runtimes[0].execute(step.draft, self._step0_inputs(plan, dev, inputs, tokens, state), features)
    feature = feature[last_row]
    drafts = torch.empty(m, k, dtype=torch.int64, device=features.device)
    drafts[:, 0] = self.head.propose(feature)[0]
    for j in range(1, k):  # draft j reads draft j - 1 at the head position of its feature, last_pos + j - 1
        rt, pos = self.runtimes[1], last_pos + j - 1
        inputs_j = rt.inputs(drafts[:, j - 1], pos, slots_s, torch.arange(m + 1, device=pos.device), pos + 1,
                             slots_s, 1, plan.max_seq_len + j)
        feature = rt.execute(step.draft_next, inputs_j, feature).clone()
        drafts[:, j] = self.head.propose(feature)[0]
    state.drafts[slots_s, :k] = drafts


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_eagle_drafts_equal_one_step_at_a_time(monkeypatch, device):
    """The EAGLE draft loop's batched inputs (every one-token step's positions and KV slots at once), its steps
    2..K-1 that rewrite only what moves (``execute_next``) and in-graph proposals give the drafts of the plainest
    loop: a wrong KV slot, position or (GPU: CPU attention reads positions only) sequence length in a later draft
    step changes the drafts after it (the tokens would stay right: they do not depend on the drafts)."""
    from dispatcher.runtime.drafting import EagleDrafter

    prompts = random_prompts(6, 3, vocab=300)
    params = SamplingParams(max_tokens=12, ignore_eos=True)

    def drafts_of_run():
        cfg = resolve({}, {"method": "eagle3", "num_speculative_tokens": 5}, platform="sm100", max_num_seqs=16,
                      max_num_batched_tokens=64)
        e = EngineCore(cfg, EngineArgs(preset("tiny-dense"), device=device, num_kv_blocks=300, block_size=BLOCK,
                                       max_model_len=128, async_scheduling=False))
        log = {}
        _record_drafts(e, log)
        e.generate(prompts, params)
        return log

    batched = drafts_of_run()
    monkeypatch.setattr(EagleDrafter, "propose", _one_step_at_a_time)
    plain = drafts_of_run()
    assert len(batched) > 6 * 3
    if device == "cpu":
        assert batched == plain
    else:  # bf16 logits of padded graph rows against unpadded eager rows may break a near-tie differently (and
        # an acceptance it changes moves the later proposals' positions)
        common = batched.keys() & plain.keys()
        same = sum(a == b for key in common for a, b in zip(batched[key], plain[key]))
        assert len(common) >= 0.9 * len(batched) and same >= 0.95 * sum(len(batched[key]) for key in common)


def _draft_model_one_step_at_a_time(self, step, plan, dev, inputs, hidden, tokens, accepted, first_pos,
                                    state) -> None:
    """DraftModelDrafter.propose as plainly as it can be written: each one-token step's inputs built on its own (no
    bare replays), the proposals taken from the draft LM's logits outside the graph."""
    k, m, slots_s = step.num_new_drafts, plan.num_sampling, dev.sampling_slots
    t, rt = inputs.tokens, self.runtimes[0]
    rt.execute(step.draft, rt.inputs(t[0], t[1], t[3], inputs.query_start, inputs.seq_lens, inputs.req_rows,
                                     inputs.max_query_len, inputs.max_seq_len))
    _, token, last_pos = self._last(dev, tokens, accepted, first_pos)
    drafts = torch.empty(m, k, dtype=torch.int64, device=hidden.device)
    for j in range(k):  # draft j + 1 reads draft j (the last new token first) at last_pos + j
        one, pos = self.runtimes[1], last_pos + j
        out = one.execute(step.draft_next, one.inputs(token, pos, slots_s, torch.arange(m + 1, device=pos.device),
                                                      pos + 1, slots_s, 1, plan.max_seq_len + j + 1))
        drafts[:, j] = token = self.head.propose(out)[0]
    state.drafts[slots_s, :k] = drafts


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_draft_model_drafts_equal_one_step_at_a_time(monkeypatch, device):
    """The draft model's loop (every one-token step's positions and KV slots at once, its steps 2..K that rewrite
    only what moves, in-graph proposals) gives the drafts of the plainest loop; its draft LM (tiny-moe for a
    tiny-dense target) is not the target, so its drafts differ from the tokens and show a wrong slot or position."""
    from dispatcher.runtime.drafting import DraftModelDrafter

    prompts = random_prompts(6, 4, vocab=300)
    params = SamplingParams(max_tokens=12, ignore_eos=True)

    def drafts_of_run():
        cfg = resolve({}, {"method": "draft_model", "model": "tiny-moe", "num_speculative_tokens": 4},
                      platform="sm100", max_num_seqs=16, max_num_batched_tokens=64)
        e = EngineCore(cfg, EngineArgs(preset("tiny-dense"), device=device, num_kv_blocks=300, block_size=BLOCK,
                                       max_model_len=128, async_scheduling=False))
        log = {}
        _record_drafts(e, log)
        e.generate(prompts, params)
        return log, e.scheduler.stats

    batched, stats = drafts_of_run()
    assert stats.drafts_accepted < stats.drafts_verified
    monkeypatch.setattr(DraftModelDrafter, "propose", _draft_model_one_step_at_a_time)
    plain, _ = drafts_of_run()
    assert len(batched) > 6 * 3
    if device == "cpu":
        assert batched == plain
    else:  # bf16 near-ties, as for EAGLE above
        common = batched.keys() & plain.keys()
        same = sum(a == b for key in common for a, b in zip(batched[key], plain[key]))
        assert len(common) >= 0.9 * len(batched) and same >= 0.95 * sum(len(batched[key]) for key in common)


def test_adaptive_verification_uses_the_runtime_measured_cost_curve():
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive_verification": True}
    cfg = resolve({}, spec, platform="sm100", max_num_seqs=16, max_num_batched_tokens=256)
    engine = EngineCore(cfg, EngineArgs(preset("tiny-dense"), num_kv_blocks=200, block_size=BLOCK, max_model_len=128))
    curve = engine.scheduler.config.step_ms
    av = next(g for g in engine.plan.graph_sets if g.kind == "full_varlen")
    assert curve.tokens == av.sizes and all(ms > 0 for ms in curve.ms)
    prompts = random_prompts(6, 9, vocab=30)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    eager = EngineCore(resolve({"cudagraph_mode": "NONE"}, None, platform="sm100", max_num_seqs=16,
                               max_num_batched_tokens=256),
                       EngineArgs(preset("tiny-dense"), num_kv_blocks=200, block_size=BLOCK, max_model_len=128))
    assert engine.generate(prompts, params) == eager.generate(prompts, params)


def test_jit_watch_reports_each_compile_once_with_its_constants():
    """What the worker logs and the step trace counts when Triton compiles inside a step: each compile once (take()
    empties it), the kernel's name with its compile-time constants by parameter name, Triton's key kept."""
    pytest.importorskip("triton")
    from types import SimpleNamespace

    from dispatcher.runtime.jit import JitWatch
    from models.triton_attention import _merge_splits_kernel

    watch = JitWatch()
    if not watch.available:
        pytest.skip("this Triton has no compile hooks")
    params = _merge_splits_kernel.params
    index = {p.name: i for i, p in enumerate(params)}
    fn = SimpleNamespace(name="_merge_splits_kernel", jit_function=_merge_splits_kernel)
    assert watch._before() is False  # (True would make Triton skip the compile)
    assert watch._after(fn=fn, compile={"constants": {(index["SPLITS_PAD"],): 4, (index["num_splits"],): 3}},
                        repr="r", key=("k",)) is False
    count, seconds, kernels = watch.take()
    assert count == 1 and seconds >= 0 and kernels == ["_merge_splits_kernel(SPLITS_PAD=4)"]
    assert watch.take() == (0, 0.0, []) and watch.history[-1] == "r key=('k',)"
    # compiles set aside (delayed capture's units in a gap between steps) are no step's: the step around them
    # reports its own only
    watch._after(fn=fn, compile={"constants": {(index["SPLITS_PAD"],): 8}}, repr="a", key=("a",))
    with watch.set_aside():
        watch._after(fn=fn, compile={"constants": {(index["SPLITS_PAD"],): 16}}, repr="b", key=("b",))
    count, _, kernels = watch.take()
    assert count == 1 and kernels == ["_merge_splits_kernel(SPLITS_PAD=8)"]
