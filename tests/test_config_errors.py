"""Bad configurations get one clear error each, naming the field, the value and the limit."""

import pytest

from dispatcher.plan.config import ConfigError, resolve

AV5 = {"method": "dspark", "num_speculative_tokens": 5, "adaptive_verification": True}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


AUTO = {"method": "eagle3", "num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": "auto"}


def tiers(*pairs):
    return {"method": "eagle3", "num_speculative_tokens": 7, "num_speculative_tokens_per_batch_size": list(pairs)}


BAD = [
    # mixing legacy and new fields
    ({"max_cudagraph_capture_size": 1024, "max_prefill_cudagraph_capture_tokens": 2048}, None, {},
     "deprecated field max_cudagraph_capture_size cannot be mixed with max_prefill_cudagraph_capture_tokens: "
     "set the prefill/decode fields alone (or only the deprecated ones)"),
    ({"cudagraph_capture_sizes": [1, 2], "decode_cudagraph_capture_request_sizes": [1]}, None, {},
     "deprecated field cudagraph_capture_sizes cannot be mixed with decode_cudagraph_capture_request_sizes: "
     "set the prefill/decode fields alone (or only the deprecated ones)"),
    # a list above its cap
    ({"max_prefill_cudagraph_capture_tokens": 1024, "prefill_cudagraph_capture_token_sizes": [1, 2048]}, None, {},
     "prefill_cudagraph_capture_token_sizes has 2048, above max_prefill_cudagraph_capture_tokens = 1024"),
    ({"max_decode_cudagraph_capture_requests": 64, "decode_cudagraph_capture_request_sizes": [1, 128]}, None, {},
     "decode_cudagraph_capture_request_sizes has 128, above max_decode_cudagraph_capture_requests = 64"),
    ({"cudagraph_capture_sizes": [1, 2, 4096], "max_cudagraph_capture_size": 1024}, None, {},
     "cudagraph_capture_sizes has 4096, above max_cudagraph_capture_size = 1024"),
    # negative, zero, non-integer sizes
    ({"prefill_cudagraph_capture_token_sizes": [1, -4]}, None, {},
     "prefill_cudagraph_capture_token_sizes[1] must be >= 1, got -4"),
    ({"decode_cudagraph_capture_request_sizes": [0, 1]}, None, {},
     "decode_cudagraph_capture_request_sizes[0] must be >= 1, got 0"),
    ({"prefill_cudagraph_capture_token_sizes": [1, 2.5]}, None, {},
     "prefill_cudagraph_capture_token_sizes[1] must be an integer, got 2.5 (float)"),
    ({"decode_cudagraph_capture_request_sizes": [1, "8"]}, None, {},
     "decode_cudagraph_capture_request_sizes[1] must be an integer, got '8' (str)"),
    ({"prefill_cudagraph_capture_token_sizes": 512}, None, {},
     "prefill_cudagraph_capture_token_sizes must be a list of positive integers, got 512"),
    ({"max_prefill_cudagraph_capture_tokens": 0}, None, {}, "max_prefill_cudagraph_capture_tokens must be >= 1, got 0"),
    ({"max_decode_cudagraph_capture_requests": -1}, None, {},
     "max_decode_cudagraph_capture_requests must be >= 1, got -1"),
    ({"max_decode_cudagraph_capture_tokens": 1.5}, None, {},
     "max_decode_cudagraph_capture_tokens must be an integer, got 1.5 (float)"),
    # unknown fields and bad enums
    ({"max_prefill_cudagraph_capture_token": 1024}, None, {},
     "--compilation-config: unknown field 'max_prefill_cudagraph_capture_token' (did you mean "
     "'max_prefill_cudagraph_capture_tokens'?); known fields: cudagraph_mode, max_prefill_cudagraph_capture_tokens, "
     "prefill_cudagraph_capture_token_sizes, max_decode_cudagraph_capture_requests, "
     "decode_cudagraph_capture_request_sizes, max_decode_cudagraph_capture_tokens, "
     "max_full_mixed_cudagraph_capture_tokens, interactivity, cudagraph_capture_sizes, max_cudagraph_capture_size, "
     "delayed_cudagraph_capture, fit_cudagraph_capture_sizes"),
    ({}, {"method": "eagle3", "num_speculative_tokens": 3, "temperature": 1}, {},
     "--speculative-config: unknown field 'temperature'; known fields: method, num_speculative_tokens, "
     "num_speculative_tokens_per_batch_size, adaptive_verification, model, prompt_lookup_min, prompt_lookup_max, "
     "acceptance_prior, auto_tier_candidates"),
    ({"cudagraph_mode": "FULL_ONLY"}, None, {},
     "cudagraph_mode must be one of NONE, PIECEWISE, FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE; got 'FULL_ONLY'"),
    ({"interactivity": "yes"}, None, {}, "interactivity must be true or false, got 'yes'"),
    ({"delayed_cudagraph_capture": 1}, None, {}, "delayed_cudagraph_capture must be true or false, got 1"),
    ({"fit_cudagraph_capture_sizes": True, "decode_cudagraph_capture_request_sizes": [1, 2]}, None, {},
     "fit_cudagraph_capture_sizes fits the size lists to the measured step cost, so "
     "decode_cudagraph_capture_request_sizes cannot be set with it: give caps (max_prefill_cudagraph_capture_tokens, "
     "max_decode_cudagraph_capture_requests) or leave fit_cudagraph_capture_sizes out"),
    ([1, 2], None, {}, "--compilation-config must be a JSON object, got list: [1, 2]"),
    ([], None, {}, "--compilation-config must be a JSON object, got list: []"),  # (falsy: taken as no config once)
    (0, None, {}, "--compilation-config must be a JSON object, got int: 0"),
    ({}, False, {}, "--speculative-config must be a JSON object, got bool: False"),
    # speculative decoding
    ({}, {"method": "eagle3", "num_speculative_tokens": -1}, {}, "num_speculative_tokens must be in 1..63, got -1"),
    ({}, {"method": "eagle3", "num_speculative_tokens": 100}, {}, "num_speculative_tokens must be in 1..63, got 100"),
    ({}, {"method": "eagle3", "num_speculative_tokens": True}, {},
     "num_speculative_tokens must be an integer, got True (bool)"),
    ({}, {"method": "medusa", "num_speculative_tokens": 3}, {},
     "method must be one of eagle, eagle3, mtp, mtp_multi, dspark, dflash, ngram, draft_model; got 'medusa'"),
    ({}, {"num_speculative_tokens": 3}, {},
     "--speculative-config: method is required (one of eagle, eagle3, mtp, mtp_multi, dspark, dflash, ngram, "
     "draft_model)"),
    ({}, {"method": "eagle3"}, {}, "num_speculative_tokens is required with a speculative method"),
    # n-gram lengths
    ({}, {**NGRAM, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, {},
     "prompt_lookup_min = 4 exceeds prompt_lookup_max = 2"),
    ({}, {**NGRAM, "prompt_lookup_min": 0}, {}, "prompt_lookup_min must be >= 1, got 0"),
    ({}, {**NGRAM, "prompt_lookup_max": -2}, {}, "prompt_lookup_max must be >= 1, got -2"),
    ({}, {**NGRAM, "prompt_lookup_max": 65}, {}, "prompt_lookup_max = 65 exceeds the limit = 64"),
    ({}, {**NGRAM, "prompt_lookup_min": 2.0}, {}, "prompt_lookup_min must be an integer, got 2.0 (float)"),
    ({}, {**NGRAM, "prompt_lookup_max": "3"}, {}, "prompt_lookup_max must be an integer, got '3' (str)"),
    ({}, {**NGRAM, "prompt_lookup_min": True}, {}, "prompt_lookup_min must be an integer, got True (bool)"),
    ({}, {"method": "eagle3", "num_speculative_tokens": 3, "prompt_lookup_max": 3}, {},
     "--speculative-config: \"prompt_lookup_max\" is for method ngram, not 'eagle3'"),
    ({}, {"method": "draft_model", "num_speculative_tokens": 3, "model": "tiny-dense", "prompt_lookup_min": 1}, {},
     "--speculative-config: \"prompt_lookup_min\" is for method ngram, not 'draft_model'"),
    # tiers: unsorted, overlapping, malformed, above K
    ({}, tiers([1, 7], [65, 3], [32, 1]), {},
     "num_speculative_tokens_per_batch_size[2] min_batch 32 must be greater than the previous tier's 65 "
     "(tiers sorted, not overlapping)"),
    ({}, tiers([1, 7], [65, 3], [65, 1]), {},
     "num_speculative_tokens_per_batch_size[2] min_batch 65 must be greater than the previous tier's 65 "
     "(tiers sorted, not overlapping)"),
    ({}, tiers([2, 7], [65, 3]), {}, "num_speculative_tokens_per_batch_size[0] must start at min_batch 1, got 2"),
    ({}, tiers([1, 7], [65]), {},
     "num_speculative_tokens_per_batch_size[1] must be a pair of integers [min_batch, K], got [65]"),
    ({}, {**tiers([1, 7], [65, 3]), "num_speculative_tokens": 3}, {},
     "num_speculative_tokens_per_batch_size[0] K = 7 must be in 0..3 (num_speculative_tokens; 0: no drafts)"),
    ({}, tiers([1, 7], [65, -1]), {},
     "num_speculative_tokens_per_batch_size[1] K = -1 must be in 0..7 (num_speculative_tokens; 0: no drafts)"),
    ({}, {"method": "ngram", "num_speculative_tokens_per_batch_size": [[1, 0], [9, 0]]}, {},
     "num_speculative_tokens_per_batch_size: every tier has K = 0 (no drafts at any batch size): give a tier K >= 1, "
     "or leave --speculative-config out"),
    # "auto" tiers
    ({}, {"method": "eagle3", "num_speculative_tokens_per_batch_size": "auto"}, {},
     "num_speculative_tokens is required with \"num_speculative_tokens_per_batch_size\": \"auto\" (the largest K "
     "the engine may choose)"),
    ({}, {**AUTO, "num_speculative_tokens_per_batch_size": "automatic"}, {},
     "num_speculative_tokens_per_batch_size must be a list of [min_batch, K] pairs or \"auto\", got 'automatic'"),
    ({}, {**AUTO, "num_speculative_tokens_per_batch_size": {}}, {},
     "num_speculative_tokens_per_batch_size must be a non-empty list of [min_batch, K] pairs or \"auto\", got {}"),
    ({}, {"method": "eagle3", "num_speculative_tokens": 3, "acceptance_prior": 0.7}, {},
     "--speculative-config: \"acceptance_prior\" is for \"num_speculative_tokens_per_batch_size\": \"auto\", which "
     "is not set"),
    ({}, {**tiers([1, 7], [65, 3]), "auto_tier_candidates": [0, 3, 7]}, {},
     "--speculative-config: \"auto_tier_candidates\" is for \"num_speculative_tokens_per_batch_size\": \"auto\", "
     "which is not set"),
    ({}, {**AUTO, "acceptance_prior": 1.5}, {},
     "acceptance_prior must be a rate in [0, 1] or a non-empty list of per-position rates, got 1.5"),
    ({}, {**AUTO, "acceptance_prior": [0.5, 0.7]}, {},
     "acceptance_prior[1] = 0.7 exceeds acceptance_prior[0] = 0.5: a draft is accepted only after the one before "
     "it, so the rates never grow with the position"),
    ({}, {**AUTO, "acceptance_prior": [0.9, 0.8, 0.7, 0.6]}, {},
     "acceptance_prior has 4 positions, more than num_speculative_tokens = 3"),
    ({}, {**AUTO, "acceptance_prior": [0.9, "x"]}, {}, "acceptance_prior[1] = 'x' must be a rate in [0, 1]"),
    ({}, {**AUTO, "auto_tier_candidates": [0, 4]}, {},
     "auto_tier_candidates[1] K = 4 must be in 0..3 (num_speculative_tokens)"),
    ({}, {**AUTO, "auto_tier_candidates": [0, 1]}, {},
     "auto_tier_candidates [0, 1] must hold num_speculative_tokens = 3 (the largest K sizes the drafts and the KV "
     "lookahead): add it, or lower num_speculative_tokens"),
    ({}, {**AUTO, "auto_tier_candidates": []}, {},
     "auto_tier_candidates must be a non-empty list of K values (0..3), got []"),
    ({}, {**AUTO, "auto_tier_candidates": [0, 1.0, 3]}, {},
     "auto_tier_candidates[1] must be an integer, got 1.0 (float)"),
    # adaptive verification without FULL graphs
    ({"cudagraph_mode": "NONE"}, AV5, {},
     "adaptive_verification needs FULL varlen graphs, but cudagraph_mode is NONE: use cudagraph_mode "
     "FULL_AND_PIECEWISE, FULL_DECODE_ONLY or FULL, or set adaptive_verification to false"),
    ({"prefill_cudagraph_capture_token_sizes": [], "decode_cudagraph_capture_request_sizes": []}, AV5, {},
     "adaptive_verification needs FULL varlen graphs, but both size lists are [] (graphs disabled): use "
     "cudagraph_mode FULL_AND_PIECEWISE, FULL_DECODE_ONLY or FULL, or set adaptive_verification to false"),
    ({"cudagraph_mode": "PIECEWISE"}, AV5, {},
     "adaptive_verification needs FULL varlen graphs, but cudagraph_mode is PIECEWISE: use cudagraph_mode "
     "FULL_AND_PIECEWISE, FULL_DECODE_ONLY or FULL, or set adaptive_verification to false"),
    ({"decode_cudagraph_capture_request_sizes": []}, AV5, {},
     "adaptive_verification needs FULL varlen graphs, capped at the decode cap times (1 + K), but "
     "decode_cudagraph_capture_request_sizes is []: give it sizes or set adaptive_verification to false"),
    # FULL mixed graphs
    ({"max_full_mixed_cudagraph_capture_tokens": -8}, None, {},
     "max_full_mixed_cudagraph_capture_tokens must be >= 1, got -8"),
    ({"max_full_mixed_cudagraph_capture_tokens": "256"}, None, {},
     "max_full_mixed_cudagraph_capture_tokens must be an integer, got '256' (str)"),
    ({"max_full_mixed_cudagraph_capture_tokens": 256, "cudagraph_mode": "PIECEWISE"}, None, {},
     "max_full_mixed_cudagraph_capture_tokens = 256 needs cudagraph_mode FULL_AND_PIECEWISE, got PIECEWISE (FULL "
     "already runs every mixed step in a FULL graph; the others capture no token-keyed FULL graphs): set it to 0 or "
     "change the mode"),
    ({"max_full_mixed_cudagraph_capture_tokens": 4, "prefill_cudagraph_capture_token_sizes": [16, 64]}, None, {},
     "max_full_mixed_cudagraph_capture_tokens = 4 covers no size of the prefill grid (its smallest is 16): FULL "
     "mixed graphs take the prefill grid's sizes up to it"),
    # engine limits
    ({}, None, {"max_num_seqs": 0}, "max_num_seqs must be >= 1, got 0"),
    ({}, None, {"max_num_batched_tokens": "8k"}, "max_num_batched_tokens must be an integer, got '8k' (str)"),
    ({}, None, {"platform": "sm90"}, "platform must be one of sm100, default; got 'sm90'"),
]


@pytest.mark.parametrize("compilation,speculative,limits,message", BAD, ids=[m[:50] for *_, m in BAD])
def test_bad_config_has_exact_message(compilation, speculative, limits, message):
    with pytest.raises(ConfigError) as info:
        resolve(compilation, speculative, **limits)
    assert str(info.value) == message


def test_at_least_twenty_bad_configs():
    assert len(BAD) >= 20


def test_oversized_entries_dropped_with_one_warning_per_kind():
    cfg = resolve(
        {"prefill_cudagraph_capture_token_sizes": [1, 2, 4096, 8192, 16384],
         "decode_cudagraph_capture_request_sizes": [1, 64, 128, 256]},
        None, platform="sm100", max_num_seqs=100, max_num_batched_tokens=4096,
    )
    assert cfg.prefill_token_sizes == (1, 2, 4096)
    assert cfg.decode_request_sizes == (1, 64)
    assert cfg.warnings == (
        "prefill_cudagraph_capture_token_sizes: dropped 2 size(s) above max_num_batched_tokens = 4096 (8192, 16384)",
        "decode_cudagraph_capture_request_sizes: dropped 2 size(s) above max_num_seqs = 100 (128, 256)",
    )


def test_caps_above_engine_limits_are_clamped_with_a_warning():
    cfg = resolve({"max_prefill_cudagraph_capture_tokens": 32768, "max_decode_cudagraph_capture_requests": 4096},
                  None, platform="sm100", max_num_seqs=512, max_num_batched_tokens=8192)
    assert (cfg.max_prefill_tokens, cfg.max_decode_requests) == (8192, 512)
    assert len(cfg.warnings) == 2 and "exceeds max_num_batched_tokens = 8192" in cfg.warnings[0]


def test_empty_lists_disable_kinds_and_both_disable_graphs():
    cfg = resolve({"prefill_cudagraph_capture_token_sizes": []}, None, platform="sm100")
    assert cfg.cudagraph_mode.value == "FULL_AND_PIECEWISE" and cfg.prefill_token_sizes == ()
    cfg = resolve({"prefill_cudagraph_capture_token_sizes": [], "decode_cudagraph_capture_request_sizes": []},
                  None, platform="sm100")
    assert cfg.cudagraph_mode.value == "NONE"


def test_unreachable_tiers_warn():
    cfg = resolve({}, tiers([1, 7], [65, 3], [257, 1]), platform="sm100", max_num_seqs=128)
    assert [t.num_speculative_tokens for t in cfg.tiers] == [7, 3]
    assert cfg.tiers[-1].max_batch == 128
    assert cfg.warnings == (
        "num_speculative_tokens_per_batch_size: 1 tier(s) start above max_num_seqs = 128 and are never used",)


@pytest.mark.parametrize("given, resolved", [({}, (1, 3)), ({"prompt_lookup_max": 5}, (5, 5)),
                                             ({"prompt_lookup_min": 2}, (2, 2)),
                                             ({"prompt_lookup_min": 2, "prompt_lookup_max": 4}, (2, 4))])
def test_prompt_lookup_lengths_resolve_as_vllm_does(given, resolved):
    """One given sets the other (vLLM's rule); neither: 1..3 (vLLM's default is 5..5). Other methods: None."""
    cfg = resolve({}, {**NGRAM, **given})
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == resolved
    assert (cfg.to_dict()["prompt_lookup_min"], cfg.to_dict()["prompt_lookup_max"]) == resolved
    eagle = resolve({}, {"method": "eagle3", "num_speculative_tokens": 3})
    assert (eagle.prompt_lookup_min, eagle.prompt_lookup_max) == (None, None)
