"""Errors the embedded engine maps to HTTP statuses."""

from __future__ import annotations


class BadRequest(ValueError):
    """The request is malformed or asks for something impossible (HTTP 400). One line: problem and fix."""

    status = 400


class Unauthorized(PermissionError):
    """A weight/memory/control endpoint was called without the run's token (HTTP 401)."""

    status = 401


class NotFound(LookupError):
    status = 404
