"""Speculative decoding: drafters and lossless verification."""
