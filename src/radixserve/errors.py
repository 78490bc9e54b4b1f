"""Typed errors. A user's mistake names the field and the allowed range."""


class RadixServeError(Exception):
    """Base class of every error radixserve raises on purpose."""


class InvalidArgumentError(RadixServeError, ValueError):
    """A caller passed a value outside the allowed range or of the wrong type.

    `field` names the offending argument where one is to blame (the server reports it).
    """

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class SlotAllocationError(RadixServeError, ValueError):
    """A KV slot was freed twice, or a slot outside the pool was freed."""


class LockError(RadixServeError, ValueError):
    """A lock count would go below zero, or a node that left the tree was locked."""


class CacheInvariantError(RadixServeError, RuntimeError):
    """The cache's internal bookkeeping is inconsistent: this is a bug, never a user error."""


class EngineError(RadixServeError, RuntimeError):
    """The engine cannot go on: a request was lost, or a failed step left its state broken."""
