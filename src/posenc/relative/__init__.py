"""Relative encodings: terms (b), (c) and the value term, functions of j - i."""
