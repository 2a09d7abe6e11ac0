"""Absolute encodings: a code for each position, added to (or mixed into) the token embeddings."""

from ._additive import AdditiveAbsolute

__all__ = ["AdditiveAbsolute"]
