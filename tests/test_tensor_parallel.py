"""Tensor parallelism on the CPU (gloo ranks in forked processes): a rank's shard of the model computes, with its
collectives, the whole model's outputs; loaders read each rank's slices; bad sizes get clear errors."""

import pytest

torch = pytest.importorskip("torch")

from models.config import preset  # noqa: E402
from models.parallel import TensorParallelError, check_tensor_parallel, shard_config  # noqa: E402
from models.transformer import build_model  # noqa: E402
from tests.test_loader import logits as loader_logits  # noqa: E402
from tests.tputil import run_ranks  # noqa: E402

TOKENS = [5, 17, 3, 99, 42, 7, 300, 511, 0, 64]
SHAPES = {
    "dense": preset("tiny-dense"),
    "dense-kv1": preset("tiny-dense").with_(num_kv_heads=1),  # fewer KV heads than ranks: replicated
    "moe-shared": preset("tiny-moe").with_(attention_bias=True, qk_norm=True, norm_topk_prob=False,
                                           shared_expert_intermediate_size=48, vocab_size=500),
    "gemma-like": preset("tiny-dense").with_(sandwich_norms=True, tie_word_embeddings=True, embedding_scale=8.0,
                                             final_logit_softcap=30.0, vocab_size=450),
}


def logits(model, tokens=TOKENS):
    return loader_logits(model, tokens)  # (a one-sequence prefill's logits, as tests/test_loader.py computes them)


def _preset_logits(tp, cfg):
    with torch.inference_mode():
        model = build_model(cfg, "cpu", torch.float32, seed=3, tp=tp)
        assert model.cfg.num_heads == cfg.num_heads // tp.size
        return logits(model)


@pytest.mark.parametrize("name", list(SHAPES))
def test_two_ranks_compute_the_whole_models_logits(tmp_path, name):
    cfg = SHAPES[name]
    with torch.inference_mode():
        want = logits(build_model(cfg, "cpu", torch.float32, seed=3))
    got = run_ranks(_preset_logits, 2, str(tmp_path), cfg)
    for rank_logits in got:  # every rank has the whole rows (all-gathered), the same ones
        torch.testing.assert_close(rank_logits, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[0], got[1])


def _checkpoint_logits(tp, path, dtype):
    from models.loader import load_model

    with torch.inference_mode():
        return logits(load_model(path, "cpu", dtype, tp=tp))


@pytest.mark.parametrize("model_type", ["llama", "qwen2_moe", "mixtral", "phi3"])
def test_ranks_load_their_slices_of_a_checkpoint(tmp_path, model_type):
    from models.loader import load_checkpoint, save_checkpoint

    cfg = {"llama": preset("tiny-dense"), "phi3": preset("tiny-dense"),
           "mixtral": preset("tiny-moe").with_(intermediate_size=32),
           "qwen2_moe": SHAPES["moe-shared"].with_(qk_norm=False)}[model_type]
    save_checkpoint(build_model(cfg, "cpu", torch.float32, seed=5), str(tmp_path / "ckpt"), model_type)
    with torch.inference_mode():
        want = logits(load_checkpoint(str(tmp_path / "ckpt"), "cpu", torch.float32))
    got = run_ranks(_checkpoint_logits, 2, str(tmp_path), str(tmp_path / "ckpt"), torch.float32)
    torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-5)


def test_ranks_keep_their_slices_of_a_4bit_gguf(tmp_path):
    """A Q4_0 GGUF in bfloat16 on the CPU: each rank's projections stay 4-bit (its rows, or whole groups of
    columns), and the two ranks' logits are one rank's within bfloat16 rounding."""
    from models.gguf_loader import write_gguf
    from models.int4 import int4_available

    if not int4_available("cpu", torch.bfloat16):
        pytest.skip("this torch has no int4 CPU GEMM")
    cfg = preset("tiny-dense").with_(hidden_size=128, head_dim=32, intermediate_size=256)
    path = str(tmp_path / "q4.gguf")
    write_gguf(build_model(cfg, "cpu", torch.float32, seed=5), path, "llama", "Q4_0")
    want = run_ranks(_checkpoint_logits, 1, str(tmp_path), path, torch.bfloat16)[0]
    got = run_ranks(_gguf_rank, 2, str(tmp_path), path)
    assert got[0][1] == cfg.num_layers * 4  # every projection 4-bit on each rank
    scale = float(want.abs().max())
    assert float((got[0][0] - want).abs().max()) < 0.02 * scale


def _gguf_rank(tp, path):
    from models.int4 import Int4Linear
    from models.loader import load_model

    with torch.inference_mode():
        model = load_model(path, "cpu", torch.bfloat16, tp=tp)
        kept = sum(isinstance(m, Int4Linear) for m in model.modules())
        return logits(model), kept


def test_sizes_that_do_not_split_the_model_are_refused():
    dense = preset("tiny-dense")  # 4 heads, 2 KV heads, intermediate 128
    with pytest.raises(TensorParallelError, match="num_attention_heads = 4"):
        check_tensor_parallel(dense, 3)
    with pytest.raises(TensorParallelError, match="num_key_value_heads = 6"):
        check_tensor_parallel(dense.with_(num_heads=12, num_kv_heads=6), 4)
    with pytest.raises(TensorParallelError, match="intermediate_size = 130"):
        check_tensor_parallel(dense.with_(intermediate_size=130), 4)
    with pytest.raises(TensorParallelError, match="moe_intermediate_size = 30"):
        check_tensor_parallel(preset("tiny-moe").with_(moe_intermediate_size=30), 4)
    with pytest.raises(TensorParallelError, match=">= 1"):
        check_tensor_parallel(dense, 0)
    assert shard_config(dense.with_(num_kv_heads=1), 4).num_kv_heads == 1  # replicated
    assert shard_config(dense, 2).num_kv_heads == 1 and shard_config(dense, 2).intermediate_size == 64


def _plan_check(tp, plans):
    from models.parallel import check_same_plan

    return check_same_plan(tp, plans[tp.rank])


def test_ranks_with_different_plans_stop_at_start_up_naming_them(tmp_path):
    same = run_ranks(_plan_check, 2, str(tmp_path), [{"decode": [1, 2, 4]}, {"decode": [1, 2, 4]}])
    assert same[0] == same[1]
    with pytest.raises(RuntimeError, match=r"capture plans differ \(plan hash per rank: rank 0 \w+, rank 1 \w+\)"):
        run_ranks(_plan_check, 2, str(tmp_path), [{"decode": [1, 2, 4]}, {"decode": [1, 2, 8]}])


def test_the_flag_is_checked_against_the_model_and_the_gpus():
    from dispatcher.configure import check_tensor_parallel_size
    from dispatcher.plan.config import ConfigError, resolve
    from models.default_model import default_model_path
    from models.loader import read_model_config

    smollm = read_model_config(default_model_path())  # 9 heads, 3 KV heads
    with pytest.raises(ConfigError, match="--tensor-parallel-size: tensor_parallel_size = 2 does not divide the "
                                          "model's num_attention_heads = 9"):
        check_tensor_parallel_size(2, smollm, "cpu")
    check_tensor_parallel_size(3, smollm, "cpu")
    with pytest.raises(ConfigError, match="must be >= 1, got 0"):
        check_tensor_parallel_size(0, smollm, "cpu")
    if torch.cuda.device_count() < 8:
        with pytest.raises(ConfigError, match=f"only {torch.cuda.device_count()} GPU"):
            check_tensor_parallel_size(8, preset("tiny-dense").with_(num_heads=8, num_kv_heads=8), "cuda")
    delayed = resolve({"delayed_cudagraph_capture": True}, None, platform="default")
    with pytest.raises(ConfigError, match="delayed_cudagraph_capture is not supported with tensor parallelism"):
        check_tensor_parallel_size(3, smollm, "cpu", cfg=delayed)
