"""Every error nanpass raises is a NanpassError whose message starts with ``nanpass:``."""

from __future__ import annotations


class NanpassError(Exception):
    """Base class of all nanpass errors."""

    def __init__(self, message: str):
        if not message.startswith("nanpass:"):
            message = f"nanpass: {message}"
        super().__init__(message)


class ConfigError(NanpassError, ValueError):
    """A bad option: the message names the bad value and the valid choices."""


class CaptureError(NanpassError):
    """No capture path (torch.fx, then dynamo) could turn the model into a graph."""


class RewriteError(NanpassError):
    """The rewrite pass failed on a node; the message names the node and its source line."""


class NanpassTypeError(NanpassError, TypeError):
    """An argument of the wrong type (``harden(3)``): the message says what was given."""
