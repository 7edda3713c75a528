"""Why a KV transfer failed: one ``TransferError`` subclass per cause, raised on either side."""

from __future__ import annotations


class TransferError(Exception):
    """A KV transfer did not complete."""


class AuthError(TransferError):
    """The peer did not prove it holds the cluster's shared secret."""


class ProtocolError(TransferError):
    """The peer sent something the wire format does not allow (bad magic, version, sizes)."""


class CorruptFrameError(ProtocolError):
    """A header or payload checksum did not match: bytes were damaged on the way."""


class TruncatedError(TransferError):
    """The stream ended in the middle of a frame or before the transfer was complete."""


class ConnectionLostError(TransferError):
    """A connection carrying the transfer was reset or closed by the network."""


class StallError(TransferError):
    """No progress for longer than the configured stall timeout."""


class RejectedError(TransferError):
    """The receiver refused or failed the transfer and said why."""


class TransferAbortedError(TransferError):
    """The sender gave up on the transfer and told the receiver so."""


class DroppedError(TransferError):
    """The receiver dropped the transfer: no consumer claimed it in time, or its table needed the room."""


def first_transfer_error(group: BaseExceptionGroup) -> BaseException:
    """The TransferError inside a TaskGroup's exception group (else its first exception)."""
    for e in group.exceptions:
        if isinstance(e, BaseExceptionGroup):
            return first_transfer_error(e)
        if isinstance(e, TransferError):
            return e
    return group.exceptions[0]
