"""Helpers shared by the test suite and the benchmarks (not used by the services)."""
