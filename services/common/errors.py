"""Errors that cross service boundaries, each tied to the gRPC status it maps to.

Domain code (engine, router policy, tokenizer) raises these without importing gRPC; one
server interceptor turns them into status codes, so a user's mistake is never UNKNOWN/INTERNAL.
The `code` is the name of a `grpc.StatusCode` member.
"""

from __future__ import annotations


class SluiceError(Exception):
    """Base class: an error with a gRPC status name and a message meant for the caller."""

    code: str = "INTERNAL"

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s


class InvalidArgumentError(SluiceError, ValueError):
    """Bad parameters, an empty prompt, token ids outside the vocabulary, a prompt too long."""

    code = "INVALID_ARGUMENT"


class NotFoundError(SluiceError, LookupError):
    """An unknown adapter or model."""

    code = "NOT_FOUND"


class ResourceExhaustedError(SluiceError):
    """Queue full, rate limited, or a request that can never fit in the KV cache."""

    code = "RESOURCE_EXHAUSTED"


class UnavailableError(SluiceError):
    """Draining, no engine, or a dependency went away."""

    code = "UNAVAILABLE"


class DeadlineExceededError(SluiceError):
    """The caller's deadline passed before the work was done."""

    code = "DEADLINE_EXCEEDED"


class UnauthenticatedError(SluiceError):
    """A missing or wrong API key."""

    code = "UNAUTHENTICATED"


class AlreadyExistsError(SluiceError):
    """An idempotency key reused with a different payload."""

    code = "ALREADY_EXISTS"


class FailedPreconditionError(SluiceError):
    """The system is not in a state to serve this (e.g. model files missing)."""

    code = "FAILED_PRECONDITION"
