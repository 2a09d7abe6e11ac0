"""Bias encodings: a position-only term (d) added to the attention logits."""
