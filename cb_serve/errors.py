"""The engine's typed errors: what the serving layer tells a client depends only on the type.

Every class pickles with its message and ``param`` (they cross Ray's process boundary)."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """The request's own input is out of range (a 400 naming ``param``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self):
        return type(self), (str(self), self.param)


class RequestIdInUseError(InvalidRequestError):
    """A request with this id is still in flight (a 409): ids name one request at a time."""


class EngineError(RuntimeError):
    """Base of the engine's runtime errors. ``replica``: the serving replica that raised it, if any
    (the router avoids that replica when it retries)."""

    retryable = False

    def __init__(self, message: str = "", replica: str | None = None) -> None:
        super().__init__(message)
        self.replica = replica

    def __reduce__(self):
        return type(self), (str(self), self.replica)


class EngineOverloadedError(EngineError):
    """The waiting queue is full (``max_waiting_requests``); retry later."""

    retryable = True


class EngineDeadError(EngineError):
    """The engine loop stopped while it held this request; the replica must be replaced."""

    retryable = True


class EngineUnavailableError(EngineError):
    """The engine did not take this request (it is dead or shutting down): safe to send it to
    another replica at once."""

    retryable = True


class EngineShutdownError(EngineError):
    """The engine is shutting down; retry (another replica)."""

    retryable = True


class RequestFailedError(EngineError):
    """Processing this one request raised (its detokenization, stop handling, ...); the engine
    and every other request go on."""


class StepFailedError(EngineError):
    """The engine step holding this request raised for a reason not tied to one request (a
    kernel error, out of memory); its requests fail, their KV blocks are freed, the engine goes on."""

    retryable = True


class EngineFatalError(EngineError):
    """The engine cannot go on (raised by the step; ends the engine loop)."""
