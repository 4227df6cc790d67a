"""The engine side: the step loop (scheduler -> dispatch -> worker -> outputs), step traces, and the offline tools
that drive the real scheduler and dispatcher (simulate, replay)."""
