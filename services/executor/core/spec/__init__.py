"""Speculative decoding: the configuration, the proposers and greedy verification."""
