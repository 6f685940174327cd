"""What several benchmarks share: statistics (:mod:`.stats`), workloads (:mod:`.workloads`),
the random checkpoints (:mod:`.models`), the transformers reference loops (:mod:`.hf`),
engines on a loaded model and their request loop (:mod:`.engines`), and forward timers for
the facade's runner hook (:mod:`.timers`)."""
