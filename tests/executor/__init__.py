"""Executor tests (a package, so that helper modules import relatively and file names never
clash with other services' tests)."""
