"""Tools beside the services: tiny real checkpoints (random weights, a real tokenizer) for the
tests, the benchmarks and a first ``pagedserve serve`` without a model."""
