"""twogrid's dispatcher: configuration resolution, capture grids and plans, and O(1) step dispatch; the offline API
(``from dispatcher import LLM, SamplingParams``).

Importing this package stays light (``twogrid plan`` never imports torch): the offline API's names load on first use.
"""

_LAZY = {
    "LLM": "dispatcher.llm",
    "SamplingParams": "scheduler.request",
    "RequestOutput": "dispatcher.engine.output",
    "CompletionOutput": "dispatcher.engine.output",
}
__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dispatcher' has no attribute {name!r}")
