"""paraspec: lossless speculative decoding that keeps several devices busy at once.

The names below load on first use (PEP 562), so that `import paraspec` (and `python -m paraspec`, which imports
this package first) stays light until an Engine is needed: the command line protects Ctrl-C before torch loads."""

from importlib import import_module

_WHERE = {
    "Engine": "paraspec.engine",
    "EngineBusy": "paraspec.errors",
    "EngineClosed": "paraspec.errors",
    "GenerationResult": "paraspec.streams",
    "Stream": "paraspec.streams",
    "StreamCancelled": "paraspec.errors",
    "SamplingParams": "paraspec.sampling",
    "GenerationStats": "paraspec.stats",
}

__all__ = list(_WHERE)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'paraspec' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
