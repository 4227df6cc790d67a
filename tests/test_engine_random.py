"""Random end-to-end runs through EngineCore on the CPU (issue 9): random prompt lengths (one past the token budget
and exact multiples of a chunk among them), random max_tokens, greedy and seeded sampled requests, aborts at every
point of the step cycle, a KV cache small enough to preempt, every speculative method and tiers, run twice: through
the graph path (the static padded backend) and eagerly (graphs off). Both runs must give every request that neither
aborted exactly the same tokens, every request must end with exactly its tokens (max_tokens) or at its stop, and
the KV cache must be whole again at the end."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from dispatcher.engine.engine_core import EngineArgs, EngineCore  # noqa: E402
from dispatcher.plan.config import resolve  # noqa: E402
from models.config import preset  # noqa: E402
from scheduler.request import FinishReason, RequestError, SamplingParams  # noqa: E402

SPECS = [
    None,
    {"method": "ngram", "num_speculative_tokens": 3},
    {"method": "ngram", "num_speculative_tokens": 2, "adaptive_verification": True},
    {"method": "eagle3", "num_speculative_tokens": 2},
    {"method": "eagle3", "num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": [[1, 3], [3, 1]]},
    {"method": "mtp", "num_speculative_tokens": 1},
    {"method": "dflash", "num_speculative_tokens": 2},
    {"method": "dspark", "num_speculative_tokens": 2},
    {"method": "mtp_multi", "num_speculative_tokens": 2},
    {"method": "eagle3", "num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": "auto"},
    {"method": "dflash", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 2], [3, 0]]},
]
SPEC_COSTS = {"decode_step_ms": {"1": [[1, 10.0], [4, 10.0]], "2": [[1, 11.0], [4, 16.0]], "3": [[1, 12.0], [4, 22.0]],
                                 "4": [[1, 13.0], [4, 30.0]]}}
"""Auto tiers' step costs: K = 3 at one request, less drafting as the batch grows."""
PHASES = ("before_schedule", "after_schedule", "after_execute")
BLOCK = 4
MAX_MODEL_LEN = 64
EOS = preset("tiny-dense").eos_token_ids[0]


@st.composite
def workloads(draw):
    spec = draw(st.sampled_from(SPECS))
    budget = draw(st.sampled_from([16, 24, 32]))
    chunk_multiple = st.sampled_from([budget, 2 * budget]) if 2 * budget <= 40 else st.just(budget)
    prompt_len = st.one_of(st.integers(1, 12), st.just(budget + 1), chunk_multiple, st.integers(13, 40))
    request = st.fixed_dictionaries({
        "prompt_len": prompt_len,
        "max_tokens": st.integers(1, 10),
        "sampled": st.booleans(),
        "ignore_eos": st.booleans(),
        "seed": st.integers(0, 2**31),
    })
    ops = draw(st.lists(st.one_of(
        st.tuples(st.just("add"), request),
        st.tuples(st.just("step")), st.tuples(st.just("step")), st.tuples(st.just("step")),
        st.tuples(st.just("abort"), st.integers(0, 20), st.sampled_from(PHASES)),
    ), min_size=4, max_size=24))
    per_request = -(-(MAX_MODEL_LEN + 4 + 4) // BLOCK)  # prompt + output + drafts + lookahead
    num_blocks = draw(st.integers(per_request, 3 * per_request))  # one to three requests' worth: preemption
    wait = draw(st.sampled_from([0, None, 3]))  # the graph run's admission_wait_steps (None: the default, 4 under
    # speculative decoding; the eager run's is 0)
    return spec, budget, num_blocks, wait, ops


def make_engine(spec, budget, num_blocks, graphs: bool, cost_table: str, spec_costs: str | None = None,
                wait: int | None = 0) -> EngineCore:
    if not graphs and spec and spec.get("adaptive_verification"):  # adaptive verification needs FULL graphs
        spec = {k: v for k, v in spec.items() if k != "adaptive_verification"}
    cc = {} if graphs else {"cudagraph_mode": "NONE"}
    cfg = resolve(cc, spec, platform="sm100", max_num_seqs=4, max_num_batched_tokens=budget)
    return EngineCore(cfg, EngineArgs(preset("tiny-dense"), num_kv_blocks=num_blocks, block_size=BLOCK,
                                      max_model_len=MAX_MODEL_LEN, av_cost_table=cost_table, seed=11,
                                      spec_cost_table=spec_costs, auto_tier_interval=3, admission_wait_steps=wait))


def phase_aborts(engine: EngineCore, reasons: dict, aborted: set):
    """Aborts queued by phase of the step cycle: (the queues, abort(phase), which aborts a phase's queue and notes
    each request it ended in ``reasons`` and ``aborted``)."""
    pending = {phase: [] for phase in PHASES}

    def abort(phase):
        for rid in pending[phase]:
            if engine.abort(rid):
                aborted.add(rid)
                reasons[rid] = FinishReason.ABORT
        pending[phase].clear()

    return pending, abort


def take_outputs(engine: EngineCore, step, result, tokens: dict, reasons: dict) -> None:
    """A step's result into the scheduler; each request's new tokens into ``tokens``, its finish into ``reasons``."""
    for o in engine.update(step, result):
        tokens[o.request_id] += o.new_token_ids
        if o.finished:
            reasons[o.request_id] = o.finish_reason


def run_out(engine: EngineCore, step, ids: list[str], reasons: dict, busy=lambda: False) -> None:
    """Step until nothing is live (and, by ``busy``, nothing in flight); then every request has ended and the KV
    cache is whole again."""
    for _ in range(600):
        if not engine.has_unfinished() and not busy():
            break
        step()
    assert not engine.has_unfinished() and not busy()
    assert engine.scheduler.kv.num_free == engine.scheduler.config.num_kv_blocks, "KV blocks leaked"
    for rid in ids:
        assert rid in reasons, f"{rid} never finished"


def run(engine: EngineCore, ops) -> tuple[dict, dict, set]:
    """Play the ops; returns (tokens by request, finish reason by request, aborted request ids)."""
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, FinishReason] = {}
    aborted: set[str] = set()
    pending, abort = phase_aborts(engine, reasons, aborted)
    ids: list[str] = []

    def step():
        abort("before_schedule")
        step = engine.schedule()
        if step is None:
            return
        abort("after_schedule")
        result = engine.execute(step)
        abort("after_execute")
        take_outputs(engine, step, result, tokens, reasons)

    for op in ops:
        if op[0] == "add":
            r = op[1]
            prompt = [(7 * len(ids) + 13 * i) % 500 + 3 for i in range(r["prompt_len"])]
            params = SamplingParams(max_tokens=r["max_tokens"], ignore_eos=r["ignore_eos"],
                                    temperature=1.0 if r["sampled"] else 0.0, seed=r["seed"] if r["sampled"] else None)
            try:
                rid = engine.add_request(prompt, params)
            except RequestError:  # prompt + max_tokens over max_model_len: refused, nothing queued
                assert r["prompt_len"] + r["max_tokens"] > MAX_MODEL_LEN
                continue
            ids.append(rid)
            tokens[rid] = []
        elif op[0] == "abort" and ids:
            pending[op[2]].append(ids[op[1] % len(ids)])
        elif op[0] == "step":
            step()
    run_out(engine, step, ids, reasons)
    return tokens, reasons, aborted


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(workloads())
def test_random_runs_match_eager_and_end_exactly(tmp_path_factory, workload):
    spec, budget, num_blocks, wait, ops = workload
    table = tmp_path_factory.mktemp("av") / "curve.json"
    table.write_text(json.dumps({"tokens": [1, 16, 64, 256], "ms": [1.0, 1.2, 2.0, 5.0]}))
    spec_costs = table.parent / "spec_costs.json"
    spec_costs.write_text(json.dumps(SPEC_COSTS))
    graphs = run(make_engine(spec, budget, num_blocks, True, str(table), str(spec_costs), wait), ops)
    eager = run(make_engine(spec, budget, num_blocks, False, str(table), str(spec_costs)), ops)
    adds = [op[1] for op in ops if op[0] == "add" and op[1]["prompt_len"] + op[1]["max_tokens"] <= MAX_MODEL_LEN]
    for (tokens, reasons, aborted) in (graphs, eager):
        for i, r in enumerate(adds):
            rid = f"req-{i}"
            if rid in aborted:
                continue
            out = tokens[rid]
            if reasons[rid] is FinishReason.LENGTH:
                assert len(out) == r["max_tokens"]
            else:
                assert reasons[rid] is FinishReason.STOP and not r["ignore_eos"] and out[-1] == EOS
                assert len(out) <= r["max_tokens"] and EOS not in out[:-1]
    # The eager run has no adaptive verification (it needs FULL graphs): it verifies other drafts, which leaves greedy
    # tokens alone but not sampled ones (another acceptance path draws other random numbers). So does the graph run's
    # admission wait under speculation: its requests start in other steps, and tiers give them other K's.
    held = wait if wait is not None else 4 if spec else 0  # (None: the default, 4 steps under speculation)
    other_drafts = bool(spec and (spec.get("adaptive_verification") or held))
    for i, r in enumerate(adds):
        rid = f"req-{i}"
        if rid not in graphs[2] and rid not in eager[2] and not (other_drafts and r["sampled"]):
            assert graphs[0][rid] == eager[0][rid], f"{rid}: graphs and eager disagree ({spec})"


def test_an_eagle_head_on_its_own_fitted_token_grid_generates_as_eager():
    """Fitted grids (``fit_cudagraph_capture_sizes``) give an EAGLE-style head's step 0 the powers of two of the
    target's token grid (``gridfit.head_token_grid``): a mixed step then pads the head's rows to another size than
    the target's, and every request's greedy tokens stay those of an eager run."""
    from dispatcher.plan.capture_plan import build_plan
    from dispatcher.plan.gridfit import StepCost

    cost = StepCost(((1, 1.0), (4, 1.1), (8, 1.6), (16, 3.0), (32, 6.0)), ((4, ((1, 1.2), (4, 3.0))),), "test")
    spec = {"method": "eagle3", "num_speculative_tokens": 3}
    prompts = [[(11 * i + 5 * j) % 400 + 3 for j in range(n)] for i, n in enumerate((3, 6, 11, 13, 21, 27, 9))]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    outs, shapes = [], set()
    for graphs in (True, False):
        cc = {"fit_cudagraph_capture_sizes": True} if graphs else {"cudagraph_mode": "NONE"}
        cfg = resolve(cc, spec, platform="sm100", max_num_seqs=4, max_num_batched_tokens=32,
                      step_cost=cost if graphs else None)
        if graphs:
            sets = {g.runner: g.sizes for g in build_plan(cfg).graph_sets if g.kind == "piecewise"}
            assert sets["eagle3"] == (1, 2, 4, 8, 16, 32) and len(sets["target"]) > len(sets["eagle3"])
        engine = EngineCore(cfg, EngineArgs(preset("tiny-dense"), num_kv_blocks=64, block_size=BLOCK,
                                            max_model_len=MAX_MODEL_LEN, seed=11))
        tokens: dict[str, list[int]] = {}
        for p in prompts:
            tokens[engine.add_request(p, params)] = []
        while engine.has_unfinished():
            step = engine.schedule()
            if step is None:
                continue
            d = step.descs
            if graphs and d.draft is not None and d.draft.mode == "PIECEWISE":
                shapes.add((d.target.num_tokens, d.draft.num_tokens))
            for o in engine.update(step, engine.execute(step)):
                tokens[o.request_id] += o.new_token_ids
        outs.append(tokens)
    assert any(t != d for t, d in shapes), shapes  # (some step padded the head's rows past the target's)
    assert outs[0] == outs[1] and all(len(t) == 10 for t in outs[0].values())


@st.composite
def ngram_workloads(draw):
    """Greedy prompts that repeat themselves (a random period), a random K (or tiers) and n-gram range, a token
    budget that chunks and a KV cache that may preempt."""
    k = draw(st.integers(1, 4))
    lo = draw(st.integers(1, 3))
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lo,
            "prompt_lookup_max": draw(st.integers(lo, 4))}
    if k > 1 and draw(st.booleans()):
        spec["num_speculative_tokens_per_batch_size"] = [[1, k], [3, 1]]
    prompts = []
    for _ in range(draw(st.integers(1, 6))):
        base = draw(st.lists(st.integers(3, 499), min_size=1, max_size=6))
        prompts.append([base[i % len(base)] for i in range(draw(st.integers(1, 30)))])
    per_request = -(-(MAX_MODEL_LEN + 4 + 4) // BLOCK)
    return (spec, draw(st.sampled_from([16, 32])), draw(st.integers(per_request, 3 * per_request)), prompts,
            draw(st.integers(1, 30)))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ngram_workloads())
def test_ngram_greedy_equals_no_speculation_with_async_scheduling(workload):
    """n-gram drafting on the device, with step t + 1 submitted before step t's result is back: greedy tokens are
    exactly those of no speculation (the drafts only change how many tokens a step yields)."""
    spec, budget, num_blocks, prompts, max_tokens = workload
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    outputs = []
    for s in (spec, None):
        engine = make_engine(s, budget, num_blocks, True, "")
        assert engine.async_scheduling
        outputs.append(engine.generate(prompts, params))
        assert engine.scheduler.kv.num_free == engine.scheduler.config.num_kv_blocks, "KV blocks leaked"
    assert outputs[0] == outputs[1]
    assert all(len(o) == max_tokens for o in outputs[0])


@st.composite
def in_flight_workloads(draw):
    """Greedy requests of random lengths and max_tokens (EOS kept or ignored), a speculative method or none, a
    token budget that chunks and a KV cache that may preempt."""
    spec = draw(st.sampled_from([None, SPECS[1], SPECS[3], SPECS[4], SPECS[7]]))
    requests = draw(st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12), st.booleans()), min_size=1, max_size=7))
    per_request = -(-(MAX_MODEL_LEN + 3 * 4 + 4) // BLOCK)  # prompt + output + three steps' drafts + lookahead
    aborts = draw(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 8)), max_size=3))  # (request, after step)
    return spec, draw(st.sampled_from([16, 32])), draw(st.integers(per_request, 3 * per_request)), requests, aborts


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(in_flight_workloads())
def test_three_steps_in_flight_generate_as_one_at_a_time(workload):
    """``steps_in_flight = 3`` (a step scheduled while the two before it run, every request's tokens and drafts of
    both assumed): every request's greedy tokens and finish are those of synchronous steps, a request whose
    running steps surely end it is not scheduled again, and the KV cache is whole at the end, with requests aborted
    while steps of theirs run (their tokens then depend on when: only the others are compared)."""
    spec, budget, num_blocks, requests, aborts = workload
    aborted = {f"req-{i}" for i, _ in aborts if i < len(requests)}
    runs = []
    for steps, overlap in ((3, True), (1, False)):
        cfg = resolve({}, spec, platform="sm100", max_num_seqs=4, max_num_batched_tokens=budget)
        engine = EngineCore(cfg, EngineArgs(preset("tiny-dense"), num_kv_blocks=num_blocks, block_size=BLOCK,
                                            max_model_len=MAX_MODEL_LEN, seed=11, async_scheduling=overlap,
                                            steps_in_flight=steps, admission_wait_steps=0))
        assert engine.depth == steps
        ids = [engine.add_request([(5 * i + 11 * j) % 500 + 3 for j in range(n)],
                                  SamplingParams(max_tokens=m, ignore_eos=ignore))
               for i, (n, m, ignore) in enumerate(requests)]
        tokens = {rid: [] for rid in ids}
        ends = {}
        for step, outputs in enumerate(engine.run()):
            for o in outputs:
                tokens[o.request_id] += o.new_token_ids
                if o.finished:
                    ends[o.request_id] = o.finish_reason
            for i, after in aborts:
                if after == step and i < len(ids):
                    engine.abort(ids[i])
        assert engine.scheduler.kv.num_free == num_blocks, "KV blocks leaked"
        assert not engine.has_unfinished()
        for rid, (_, m, _) in zip(ids, requests):
            assert rid in aborted or len(tokens[rid]) == m or ends[rid] is FinishReason.STOP
        runs.append(({r: t for r, t in tokens.items() if r not in aborted},
                     {r: e for r, e in ends.items() if r not in aborted}))
    assert runs[0] == runs[1]


def test_steps_in_flight_is_checked_and_bounds_the_positions_past_max_model_len():
    """--steps-in-flight outside 1..4 is refused naming the flag; each step in flight past two holds one more step's
    drafts past max_model_len (the model's positions must hold them)."""
    from dispatcher.engine.config import max_model_len_limit
    from dispatcher.plan.config import ConfigError

    cfg = resolve({}, {"method": "eagle3", "num_speculative_tokens": 3}, platform="sm100", max_num_seqs=4,
                  max_num_batched_tokens=32)
    for bad in (0, 5, True, 2.0):
        with pytest.raises(ConfigError, match="--steps-in-flight must be a step count in 1..4"):
            max_model_len_limit(cfg, 2048, 16, bad)
    # (two steps' drafts at least, 4 positions each, and the head's lookahead of K + 1 = 4)
    assert [max_model_len_limit(cfg, 2048, 16, n)[1] for n in (1, 2, 3, 4)] == [12, 12, 16, 20]
    plain = resolve({}, None, platform="sm100", max_num_seqs=4, max_num_batched_tokens=32)
    assert [max_model_len_limit(plain, 2048, 16, n)[1] for n in (2, 3)] == [1, 2]
