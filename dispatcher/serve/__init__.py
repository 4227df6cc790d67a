"""``twogrid serve``'s front end: the OpenAI-compatible HTTP app (app.py), its request and response types
(protocol.py) and the Prometheus metrics (metrics.py, free of aiohttp: the engine imports it)."""
