"""Errors that reach HTTP clients: status code, upstream error_type and message (docs/tgi-interface.md §2.8)."""

from __future__ import annotations


class InferError(Exception):
    """Base class: subclasses fix the HTTP status and error_type."""

    status: int = 500
    error_type: str = "internal"
    metric_label: str = "generation"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ValidationFailed(InferError):
    status = 422
    error_type = "validation"
    metric_label = "validation"

    def __init__(self, detail: str) -> None:
        super().__init__(f"Input validation error: {detail}")


class Overloaded(InferError):
    status = 429
    error_type = "overloaded"
    metric_label = "overloaded"

    def __init__(self) -> None:
        super().__init__("Model is overloaded")


class GenerationFailed(InferError):
    status = 424
    error_type = "generation"
    metric_label = "generation"

    def __init__(self, shard_message: str) -> None:
        super().__init__(f"Request failed during generation: Server error: {shard_message}")


class IncompleteGeneration(InferError):
    status = 500
    error_type = "incomplete_generation"
    metric_label = "incomplete"

    def __init__(self) -> None:
        super().__init__("Incomplete generation")


class IncompleteStream(InferError):
    """A stream that ended without its last token (the native stream's own error_type)."""

    status = 500
    error_type = "incomplete_generation_stream"
    metric_label = "incomplete"

    def __init__(self) -> None:
        super().__init__("Incomplete generation stream")


class TemplateFailed(InferError):
    status = 422
    error_type = "template_error"
    metric_label = "template"

    def __init__(self, detail: str) -> None:
        super().__init__(f"Template error: {detail}")


class Unhealthy(InferError):
    status = 503
    error_type = "healthcheck"

    def __init__(self) -> None:
        super().__init__("unhealthy")


class ShuttingDown(InferError):
    status = 503
    error_type = "shutdown"
    metric_label = "incomplete"

    def __init__(self, detail: str) -> None:
        super().__init__(f"Server is shutting down: {detail}")


def error_from_event(kind: str, message: str) -> InferError:
    """The HTTP error of a request that the batcher ended with an ErrorEvent."""
    if kind == "validation":
        return ValidationFailed(message)
    if kind == "shutdown":
        return ShuttingDown(message)
    if kind == "incomplete":
        return IncompleteGeneration()
    assert kind == "generation", f"unknown error kind {kind!r}"
    return GenerationFailed(message)
