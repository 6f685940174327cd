"""Layers shared by the model families: each written once, with its torch path and, where it
matters on GPU, its kernel behind ``pagedserve.kernels.ops``."""
