"""The worker side: the model, its KV cache and its CUDA graphs on one device (capture and replay), and the worker
that turns a scheduled step into sampled tokens."""
