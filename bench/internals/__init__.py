"""Benchmarks of the executor's internals, measured on purpose below its facade: host work
per step, async scheduling, tensor parallelism, the kernels (GPU checks, the MoE op), CUDA
graphs, and the scheduler's and the KV cache's own mechanisms (prefix hold-back, KV-cache
groups, tier fills, grammar masks). They may import any executor module; the benchmarks one
level up import only ``services.executor.api``."""
