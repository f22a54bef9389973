"""Errors of the P/D transfer layer; each one says what happened and what to do.

Hierarchy (callers catch the narrowest they can act on)::

    TransferError(RuntimeError)
      ProtocolError          a message failed decoding or validation (never acted on)
      HandshakeError         the metadata handshake was refused
        HandshakeTimeout     ... or not answered in time (also a TimeoutError)
      EngineError            a transfer engine could not start / register / read
        EngineReadError      one read failed (retried a bounded number of times)
        EngineUnavailable    the engine's package or driver is missing
      RequestFailed          the transfer of one request failed (reason inside)
    TopologyError(ValueError) an invalid prefill/decode parallel layout (config time)
"""

from __future__ import annotations


class TransferError(RuntimeError):
    """Base class of every runtime failure of the P/D transfer layer."""


class ProtocolError(TransferError):
    """A received message is undecodable, of an unknown kind or version, or invalid."""


class HandshakeError(TransferError):
    """The decode side refused the metadata handshake (the reason says why)."""


class HandshakeTimeout(HandshakeError, TimeoutError):
    """The decode side did not answer the metadata handshake before the deadline."""


class EngineError(TransferError):
    """A transfer engine could not be initialised, register memory or move data."""


class EngineReadError(EngineError):
    """One batched read failed (the engine's return code is in the message)."""


class EngineUnavailable(EngineError):
    """The requested engine cannot run here (package, driver or device missing)."""


class RequestFailed(TransferError):
    """The transfer of a request failed; ``request_id`` and ``reason`` say which and why."""

    def __init__(self, request_id: str, reason: str):
        self.request_id = request_id
        self.reason = reason
        super().__init__(f"transfer of request {request_id!r} failed: {reason}")


class TopologyError(ValueError):
    """Prefill/decode tensor-parallel sizes or ranks that cannot be paired."""
