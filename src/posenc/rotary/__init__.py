"""Rotary encodings: q and k are rotated by an angle proportional to their position."""
