"""The errors an Engine's callers may catch (also exported by `paraspec`)."""

from __future__ import annotations


class IncompatibleModelsError(ValueError):
    pass


class RefusedParameter(ValueError):
    """A request's sampling parameter this Engine cannot honour (Engine.check_params); `param` names it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class EngineBusy(RuntimeError):
    """The Engine is full: raised with on_busy="error", or after `wait_timeout` seconds of waiting."""


class EngineClosed(RuntimeError):
    """The Engine was closed; create a new one."""


class StreamCancelled(RuntimeError):
    """A stream was ended by someone other than its reader (a newer request from the thread that left it open, or
    engine.close()): raised at its next iteration, so that its text is never cut short without a word."""
