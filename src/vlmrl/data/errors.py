"""The user errors of data loading: the data cannot be used as it is, or is not there."""

from __future__ import annotations


class DataError(ValueError):
    """The data cannot be used as it is; the message names the file, row and field."""


class MissingData(DataError):
    """The data path does not exist (the caller adds which config field named it)."""
