"""Fused decode steps (dispatcher/runtime/decode_step.py): a uniform-decode step captured whole gives exactly what
the same step gives op by op: the same greedy tokens, the same drafts (so the same acceptance), the same fixed
acceptance draws, the same seeded samples (temperature, seed, min_p) and penalties (with the same token counts),
under every drafter that fuses (none, n-gram, EAGLE-3, EAGLE-1, mtp), tiers with K = 0, "auto" tiers, preemption
and asynchronous scheduling; steps that cannot fuse (top-k, top-p, logit bias, min_tokens, logprobs, a draft
model, block drafters) run op by op. On the CPU the fused closures run on the static backend, as graphs do."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from dispatcher.engine.engine_core import EngineArgs, EngineCore  # noqa: E402
from dispatcher.plan.config import resolve  # noqa: E402
from models.config import preset  # noqa: E402
from scheduler.request import SamplingParams  # noqa: E402

BLOCK = 4
SPEC_COSTS = {"decode_step_ms": {"1": [[1, 10.0], [8, 10.0]], "2": [[1, 11.0], [8, 20.0]],
                                 "4": [[1, 12.0], [8, 40.0]]}}
"""Auto tiers' step costs: K = 3 at a few requests, K = 1 or none as the batch grows."""


def engine_for(spec, fused: bool, tmp_path, num_kv_blocks: int = 256, fixed: float | None = None,
               device: str = "cpu") -> EngineCore:
    costs = tmp_path / "spec_costs.json"
    costs.write_text(json.dumps(SPEC_COSTS))
    cfg = resolve({}, spec, platform="sm100", max_num_seqs=8, max_num_batched_tokens=64)
    return EngineCore(cfg, EngineArgs(preset("tiny-dense"), device=device, dtype=torch.float32,
                                      num_kv_blocks=num_kv_blocks, block_size=BLOCK, max_model_len=96, seed=5,
                                      fuse_decode_steps=fused, fixed_acceptance=fixed, spec_cost_table=str(costs),
                                      auto_tier_interval=4))


def prompts(count: int = 7) -> list[list[int]]:
    """Prompts that repeat themselves (so n-gram lookup finds matches), of several lengths."""
    out = []
    for i in range(count):
        base = [(11 * i + 7 * j) % 500 + 3 for j in range(2 + i % 4)]
        out.append([base[j % len(base)] for j in range(5 + 6 * i)])
    return out


def generate(engine: EngineCore, params: SamplingParams, count: int = 7):
    tokens = engine.generate(prompts(count), params)
    s = engine.stats
    assert engine.scheduler.kv.num_free == engine.scheduler.config.num_kv_blocks, "KV blocks leaked"
    return tokens, (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, tuple(s.accepted_per_pos)), s


FUSING = [
    None,
    {"method": "ngram", "num_speculative_tokens": 3},
    {"method": "eagle3", "num_speculative_tokens": 3},
    {"method": "eagle", "num_speculative_tokens": 2},
    {"method": "mtp", "num_speculative_tokens": 1},
    {"method": "eagle3", "num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": [[1, 3], [4, 1]]},
    {"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 2], [4, 0]]},
    {"method": "eagle3", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 2], [4, 0]]},
    {"method": "eagle3", "num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": "auto"},
]


@pytest.mark.parametrize("spec", FUSING, ids=lambda s: "none" if s is None else json.dumps(s))
def test_fused_steps_equal_unfused_steps(spec, tmp_path):
    """Greedy tokens, drafts verified and accepted (per position) are those of the op-by-op step; most decode steps
    fuse (the rest are prefills and the steps around a change of tier)."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    fused_tokens, fused_acc, stats = generate(engine_for(spec, True, tmp_path), params)
    plain_tokens, plain_acc, plain_stats = generate(engine_for(spec, False, tmp_path), params)
    assert fused_tokens == plain_tokens
    assert fused_acc == plain_acc
    assert plain_stats.fused_steps == 0
    assert stats.fused_steps >= stats.steps // 2, (stats.fused_steps, stats.steps)
    if spec is not None and spec.get("method") == "ngram":
        assert stats.num_accepted_tokens > 0  # the repeating prompts make n-gram drafts that verify


def lockstep(spec, tmp_path, device: str, params: list[SamplingParams] | None = None) -> None:
    """Two engines, fused and op by op, stepped synchronously: the same outputs, and the same request state on the
    device (tokens, computed counts, drafts and their confidences) after every step. ``params``: per prompt (None:
    five greedy requests)."""
    params = params or [SamplingParams(max_tokens=16, ignore_eos=True)] * 5
    engines = [engine_for(spec, fused, tmp_path, device=device) for fused in (True, False)]
    for e in engines:
        for p, sp in zip(prompts(len(params)), params):
            e.add_request(p, sp)
    while engines[1].has_unfinished():
        outs = [e.step() for e in engines]
        assert [(o.request_id, o.new_token_ids) for o in outs[0]] == [(o.request_id, o.new_token_ids) for o in outs[1]]
        a, b = (e.worker.state for e in engines)
        live = slice(0, a.dummy)
        assert torch.equal(a.num_computed[live], b.num_computed[live])
        assert torch.equal(a.token_ids[live], b.token_ids[live])
        assert torch.equal(a.drafts[live], b.drafts[live])
        assert torch.allclose(a.draft_conf[live], b.draft_conf[live])
        counts = [e.worker.state.extras.output_counts for e in engines]
        assert (counts[0] is None) == (counts[1] is None) and (counts[0] is None or torch.equal(*counts))
    assert not engines[0].has_unfinished() and engines[0].stats.fused_steps > 0


@pytest.mark.parametrize("spec", FUSING[1:5] + FUSING[7:8], ids=lambda s: json.dumps(s))
def test_fused_steps_leave_the_request_state_of_unfused_steps(spec, tmp_path):
    lockstep(spec, tmp_path, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("spec", FUSING[:3] + FUSING[5:7], ids=lambda s: "none" if s is None else json.dumps(s))
def test_fused_graphs_on_the_gpu_leave_the_state_of_unfused_steps(spec, tmp_path):
    """The same on CUDA graphs (float32): the captured fused step computes what the separate graphs and the eager
    glue compute."""
    lockstep(spec, tmp_path, "cuda")


def test_fused_fixed_acceptance_draws_as_unfused(tmp_path):
    """Benchmarks' fixed acceptance in a fused step accepts the same seeded counts as the op-by-op step; a step in
    the other mode (fixed acceptance switched off after capture) runs op by op."""
    spec = {"method": "eagle3", "num_speculative_tokens": 3}
    params = SamplingParams(max_tokens=30, ignore_eos=True, seed=3)
    fused = engine_for(spec, True, tmp_path, fixed=2.5)
    results = [generate(e, params) for e in (fused, engine_for(spec, False, tmp_path, fixed=2.5))]
    assert results[0][:2] == results[1][:2]
    assert results[0][2].fused_steps > 0
    assert 2.0 < 1 + results[0][2].num_accepted_tokens / results[0][2].num_drafts < 3.0
    fused.worker.set_fixed_acceptance(None)
    fused.stats = type(fused.stats)()
    _, _, stats = generate(fused, params)
    assert stats.fused_steps == 0 and stats.steps > 0


def test_steps_the_fused_sampler_cannot_take_run_op_by_op(tmp_path):
    """A step with a request asking for logprobs, one whose logits are processed otherwise than by penalties (logit
    bias, min_tokens: greedy, yet not the raw argmax) or one sampling with top-k or top-p runs op by op (the fused
    graphs sample with temperature, seed, min_p and the penalties alone); the tokens are the same either way."""
    spec = {"method": "eagle3", "num_speculative_tokens": 2}
    for params in (SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2),
                   SamplingParams(max_tokens=12, ignore_eos=True, logit_bias={5: 3.0}),
                   SamplingParams(max_tokens=12, ignore_eos=True, min_tokens=4, repetition_penalty=1.3),
                   SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=9, top_k=20),
                   SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=9, top_p=0.9)):
        a = generate(engine_for(spec, True, tmp_path), params, count=3)
        b = generate(engine_for(spec, False, tmp_path), params, count=3)
        assert a[0] == b[0]
        assert a[2].fused_steps == 0


SAMPLED = [SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.8, seed=9),
           SamplingParams(max_tokens=16, ignore_eos=True),  # greedy beside sampled requests
           SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.3, seed=4, min_p=0.05),
           SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.5, seed=9, min_p=0.2),
           SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.0, seed=77)]
"""A batch the fused sampler takes: sampled requests (temperature, seed, min_p) and a greedy one."""


PENALIZED = [SamplingParams(max_tokens=16, ignore_eos=True),
             SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.8, seed=9, presence_penalty=0.5,
                            frequency_penalty=0.3, min_p=0.05),
             SamplingParams(max_tokens=16, ignore_eos=True, repetition_penalty=1.3),  # greedy, penalized
             SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.0, seed=77),
             SamplingParams(max_tokens=16, ignore_eos=True, frequency_penalty=-0.4, presence_penalty=0.2)]
"""A batch with the penalties (repetition, presence, frequency; greedy and sampled) beside unpenalized requests."""


def run_batch(engine: EngineCore, params: list[SamplingParams], first: int = 0) -> list[list[int]]:
    """Prompts ``first``.. with ``params`` (one each), run to completion: their tokens, in order."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts(first + len(params))[first:], params)]
    out: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    return [out[i] for i in ids]


@pytest.mark.parametrize("spec", FUSING[:3] + FUSING[4:5] + FUSING[6:7],
                         ids=lambda s: "none" if s is None else json.dumps(s))
def test_sampled_steps_fuse_and_draw_the_unfused_tokens(spec, tmp_path):
    """Requests sampling with temperature, seed and min_p (beside a greedy one) run fused decode steps, and every
    request's tokens, drafts and acceptance are those of the op-by-op run; the sampled requests did sample (their
    tokens are not the greedy ones)."""
    fused, plain = (engine_for(spec, f, tmp_path) for f in (True, False))
    tokens = run_batch(fused, SAMPLED)
    assert tokens == run_batch(plain, SAMPLED)
    stats = fused.stats
    assert (stats.num_drafts, stats.num_accepted_tokens, stats.accepted_per_pos) == \
        (plain.stats.num_drafts, plain.stats.num_accepted_tokens, plain.stats.accepted_per_pos)
    assert plain.stats.fused_steps == 0 and stats.fused_steps >= stats.steps // 2, (stats.fused_steps, stats.steps)
    greedy = run_batch(engine_for(spec, True, tmp_path), [SamplingParams(max_tokens=16, ignore_eos=True)] * 5)
    assert tokens[1] == greedy[1] and tokens[0] != greedy[0] and tokens[2] != greedy[2]


@pytest.mark.parametrize("spec", [None] + FUSING[1:3], ids=lambda s: "none" if s is None else json.dumps(s))
def test_sampled_fused_steps_leave_the_request_state_of_unfused_steps(spec, tmp_path):
    lockstep(spec, tmp_path, "cpu", SAMPLED)


@pytest.mark.parametrize("spec", [None] + FUSING[1:3], ids=lambda s: "none" if s is None else json.dumps(s))
def test_penalized_steps_fuse_and_leave_the_request_state_of_unfused_steps(spec, tmp_path):
    """The penalties inside the fused step (its token counts kept in the graph): the same tokens, drafts and counts
    as op by op after every step, and most decode steps fused; a penalized greedy request is not the plain one."""
    lockstep(spec, tmp_path, "cpu", PENALIZED)
    fused = engine_for(spec, True, tmp_path)
    tokens = run_batch(fused, PENALIZED)
    assert fused.stats.fused_steps >= fused.stats.steps // 2, (fused.stats.fused_steps, fused.stats.steps)
    plain = run_batch(engine_for(spec, True, tmp_path), [SamplingParams(max_tokens=16, ignore_eos=True)] * 5)
    assert tokens[0] == plain[0] and tokens[2] != plain[2] and tokens[4] != plain[4]


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [None] + FUSING[1:3], ids=lambda s: "none" if s is None else json.dumps(s))
def test_sampled_fused_graphs_on_the_gpu_leave_the_state_of_unfused_steps(spec, tmp_path):
    """The same on CUDA graphs: the captured step samples (and penalizes) with the kernel over the request state's
    tables, as the op-by-op step samples with it over gathered rows (after the penalties' own kernel)."""
    lockstep(spec, tmp_path, "cuda", SAMPLED)
    lockstep(spec, tmp_path, "cuda", PENALIZED)


def test_a_seeded_request_draws_the_same_tokens_alone_and_in_a_batch_fused_or_not(tmp_path):
    """A seeded sampled request's output depends on its seed and prompt only: alone or among other requests (sampled
    and greedy), in fused steps or op by op, with n-gram drafts or without."""
    mine = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.9, seed=1234, min_p=0.02)
    others = SAMPLED[:2] + SAMPLED[3:]
    outputs = []
    for spec in (None, FUSING[1]):
        for fused in (True, False):
            outputs.append(run_batch(engine_for(spec, fused, tmp_path), [mine], first=6)[0])
            outputs.append(run_batch(engine_for(spec, fused, tmp_path), others + [mine], first=2)[-1])
    assert len(outputs[0]) == 20 and all(o == outputs[0] for o in outputs), outputs


@pytest.mark.parametrize("spec", [{"method": "draft_model", "num_speculative_tokens": 2, "model": "tiny-dense"},
                                  {"method": "dflash", "num_speculative_tokens": 2}], ids=["draft_model", "dflash"])
def test_drafters_without_fused_steps_run_op_by_op(spec, tmp_path):
    tokens, _, stats = generate(engine_for(spec, True, tmp_path), SamplingParams(max_tokens=10, ignore_eos=True), 3)
    assert stats.fused_steps == 0 and all(len(t) == 10 for t in tokens)


def test_fused_steps_under_preemption_and_in_the_trace(tmp_path):
    """A KV cache that holds about two requests: requests are preempted and recomputed between fused steps, and
    their tokens stay those of the op-by-op run; the step trace marks fused steps."""
    spec = {"method": "eagle3", "num_speculative_tokens": 2}
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    fused = engine_for(spec, True, tmp_path, num_kv_blocks=40)
    fused.trace.close()
    trace = tmp_path / "trace.jsonl"
    from dispatcher.engine.trace import TraceWriter

    fused.trace = TraceWriter(str(trace))
    a = generate(fused, params)
    fused.close()
    b = generate(engine_for(spec, False, tmp_path, num_kv_blocks=40), params)
    assert a[0] == b[0] and a[1] == b[1]
    assert fused.scheduler.stats.preemptions > 0
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    marked = [r for r in records if r.get("fused")]
    assert len(marked) == a[2].fused_steps > 0
    assert all(r["kind"] == "uniform_decode" and r["mode"] == "FULL" for r in marked)
