"""Speculative decoding: proposers that draft tokens for a sequence, and their configuration."""
