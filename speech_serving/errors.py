"""Errors that reach the client, each carrying the contract tag the gateway maps to an HTTP status."""

from __future__ import annotations

from pipeline_contract import ERROR_INVALID_INPUT, ERROR_OVERLOADED, ERROR_UNKNOWN_VOICE


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


class UnknownVoice(ServingError):
    """An id-only request named a voice this pipeline does not hold; the client resends it with the audio."""

    tag = ERROR_UNKNOWN_VOICE

    @classmethod
    def of(cls, voice_id: str) -> UnknownVoice:
        return cls(f"voice {voice_id!r} is not held here; send the request again with its reference audio")


class RemoteError(ServingError):
    """A downstream model failed; its message (with any tag it carries) is passed through."""
