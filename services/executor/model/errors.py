"""Exceptions raised while reading and loading a model checkpoint."""

from __future__ import annotations


class ModelLoadError(Exception):
    """A checkpoint cannot be loaded: a missing or malformed file, a bad dtype or device.

    The message always names the offending file, field or value.
    """


class UnsupportedModelError(ModelLoadError, NotImplementedError):
    """The checkpoint is well-formed but uses an architecture or feature we do not implement
    (another model family, an unsupported RoPE scaling type, sliding-window attention, ...).
    """
