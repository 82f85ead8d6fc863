"""Errors that reach the client, each carrying the contract tag the gateway maps to an HTTP status."""

from __future__ import annotations

from pipeline_contract import ERROR_INVALID_INPUT, ERROR_OVERLOADED


class ServingError(RuntimeError):
    """An error whose message is safe to return to the client as is."""

    tag: str = ""

    def __str__(self) -> str:
        message = super().__str__()
        return message if not self.tag or message.startswith(self.tag) else f"{self.tag} {message}"


class InvalidInput(ServingError):
    tag = ERROR_INVALID_INPUT


class Overloaded(ServingError):
    """No capacity now; the client may retry later."""

    tag = ERROR_OVERLOADED


class RemoteError(ServingError):
    """A downstream model failed; its message (with any tag it carries) is passed through."""
