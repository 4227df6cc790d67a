"""twogrid's scheduler: requests, paged KV blocks, continuous batching with chunked prefill, preemption by
recompute, and the speculative-decoding policy (fixed K, dynamic tiers, adaptive verification)."""
