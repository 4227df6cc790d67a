"""Structured outputs on the GPU (issue 31): the bitmask applied by xgrammar's Triton kernel to graph-computed logits,
with no kernel compiled while serving, constrained greedy steps never replayed as fused step graphs, and the 24
constraints of tests/test_structured_serve.py through a served default model with CUDA graphs and asynchronous
scheduling (each constrained step's bitmask filled by the worker while its forward runs)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 3}, None], ids=["ngram", "no-sd"])
def test_constrained_steps_on_the_gpu_compile_nothing_while_serving(texts, tmp_path, spec):
    """tiny-dense with CUDA graphs, with ngram drafts (constrained steps op by op) and without (constrained decodes
    fused: two graphs captured between steps on demand), every other request under the successor stand-in grammar
    (tests/test_structured.py), every request with penalties and min_p: the constrained outputs are their chains
    exactly, overlapped and not, and no step waited for a Triton compile (the penalties' kernel of op-by-op steps,
    whose slots are views at varying offsets, included) (xgrammar's bitmask kernel was compiled at warm-up for 1, 2 and 16 rows, the fused
    steps' masking sampler on their logits buffer). The engine gets a tokenizer (a BPE within tiny-dense's 512
    tokens), as a server that takes structured requests has: only then does its worker warm those kernels up."""
    from test_pipeline import prompts
    from test_structured import FIRST, run_mixed, use_stand_in
    from textdata import train_bpe

    from dispatcher.engine.engine_core import EngineArgs, EngineCore
    from dispatcher.plan.config import resolve
    from models.config import preset

    tokenizer = train_bpe(texts[:300], str(tmp_path), vocab_size=500)
    p = [q + q[-4:] * 3 for q in prompts(20, 5)]
    for overlap in (True, False):
        cfg = resolve({}, spec, platform="sm100", max_num_seqs=32, max_num_batched_tokens=512)
        core = EngineCore(cfg, EngineArgs(preset("tiny-dense"), device="cuda", num_kv_blocks=800, block_size=16,
                                          max_model_len=256, async_scheduling=overlap, tokenizer=tokenizer))
        assert core.worker.wcfg.structured_outputs
        use_stand_in(core)
        compiles = []
        collect = core.worker.collect

        def counted(pending):
            result = collect(pending)
            compiles.append(result.jit_compiles)
            return result

        core.worker.collect = counted
        for constrained_every in (2, 1):
            outs = run_mixed(core, p, constrained_every=constrained_every, temperature=0.7, presence_penalty=0.5,
                             repetition_penalty=1.1, min_p=0.05)
            for i, (prompt, out) in enumerate(zip(p, outs)):
                if i % constrained_every == 0:
                    assert out == [(FIRST + k) % 512 for k in range(12)], (i, out)
        assert sum(compiles) == 0, compiles
        if spec is None:
            assert core.stats.fused_steps and core.worker.fused.constrained_captured


def test_constrained_decode_steps_fuse_on_cuda_graphs():
    """Without a drafter on CUDA graphs: a constrained uniform decode's two graphs are captured between steps on
    demand, then replayed around the bitmask's upload; the outputs follow their grammar and equal op by op's
    (tests/test_structured.py's CPU test)."""
    from test_structured import constrained_decodes_fuse

    constrained_decodes_fuse("cuda")


def test_every_constraint_gives_valid_output_served_on_the_gpu(tmp_path):
    from serverutil import Server
    from test_structured_serve import HERMES, test_every_constraint_gives_valid_output

    server = Server(["--device", "cuda", "--max-model-len", "1024", "--max-num-seqs", "16", "--chat-template", HERMES,
                     "--gpu-memory-utilization", "0.3"], str(tmp_path / "server.log")).wait_healthy(600)
    try:
        test_every_constraint_gives_valid_output(server)
        log = open(server.log_path, encoding="utf-8").read()
        assert "outside its grammar" not in log and "Triton compile" not in log, log[-3000:]
    finally:
        server.stop()
