"""One base for every error zerokld raises on purpose, split as vLLM splits its own (``VLLMError``): the caller's
(:class:`ZeroKLDClientError`, HTTP 4xx: change the request, nothing changed here) and this side's
(:class:`ZeroKLDServerError`, HTTP 5xx). ``status_code`` is the status a server answers with; a class whose status
depends on the case (``deltasync.HotLoadError``: 400 to 507) sets it per instance.

Each concrete class also keeps the builtin it always was (``ValueError``, ``KeyError``, ``RuntimeError``,
``OSError``), so ``except ValueError`` keeps catching what it caught: ``class Fp8QuantizationError(ZeroKLDClientError,
ValueError)``. Catch ``ZeroKLDError`` for anything zerokld refused or failed.
"""

from __future__ import annotations

__all__ = [
    "InvalidRequestError",
    "UnsupportedRequestError",
    "ZeroKLDClientError",
    "ZeroKLDError",
    "ZeroKLDServerError",
]


class ZeroKLDError(Exception):
    """Base of zerokld's errors; ``status_code``: the HTTP status a server maps it to."""

    status_code: int = 500


class ZeroKLDClientError(ZeroKLDError):
    """The caller's input, request or settings are refused (HTTP 4xx; 400 unless the class says otherwise); nothing
    was changed."""

    status_code = 400


class ZeroKLDServerError(ZeroKLDError):
    """zerokld's side failed or is misconfigured (HTTP 5xx)."""

    status_code = 500


class InvalidRequestError(ZeroKLDClientError, ValueError):
    """The caller's inputs are malformed or inconsistent with each other or with the model (HTTP 400): e.g. per-token
    loss inputs whose length is not the datum's, a loss configuration it cannot take."""


class UnsupportedRequestError(ZeroKLDClientError, NotImplementedError):
    """A well-formed request for something zerokld does not implement (HTTP 400): e.g. LoRA on the lm_head, routing
    replay under pipeline parallelism."""
