"""Speculative decoding: draft proposers and the verification rules that accept their tokens."""
