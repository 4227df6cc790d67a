"""twogrid's models: Llama-style dense and Mixtral / Qwen-MoE style decoders over a paged KV cache, drafters,
sampling and checkpoint loading. Every forward is capturable: static shapes, no host synchronization."""
