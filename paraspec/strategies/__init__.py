"""The decoding strategies, one module per paper, each registering itself in `registry` (names, options).

registry.py  OPTIONS (every strategy option), STRATEGIES, register / get_strategy
base.py      the Strategy interface, LocalStrategy, WorkerStrategy, Placement
ar.py sd.py tree.py amusd.py dsi.py easyspec.py   the strategies
"""

from paraspec.strategies.registry import (
    DRAFTER_OPTIONS,
    OPTIONS,
    STRATEGIES,
    Option,
    get_strategy,
    option_default,
    register,
    unregister,
)

__all__ = [
    "DRAFTER_OPTIONS",
    "OPTIONS",
    "STRATEGIES",
    "Option",
    "get_strategy",
    "option_default",
    "register",
    "unregister",
]

# each registers itself, in the order users see them listed (the baseline first)
from paraspec.strategies import ar, sd, amusd, dsi, tree, easyspec  # isort: skip  # noqa: E402,F401
