"""The executor's engine as a library: build one in this process and drive it with calls.

This is the executor's stable surface for code outside it (benchmarks, notebooks, tools):
it imports the executor's rooms, and nothing in the executor imports it. Everything here
is re-exported; import from ``services.executor.api`` only.

    from services.executor.api import ExecutorConfig, InProcessEngine, SamplingParams

    config = ExecutorConfig(model="models/tiny-llama", dtype="float32", device="cpu")
    with InProcessEngine(config) as engine:
        out = engine.generate(["The train"], SamplingParams(temperature=0, max_tokens=8))
        print(out[0].outputs[0].token_ids, out[0].outputs[0].text)

The contract:

- **Building.** :class:`InProcessEngine` takes an :class:`ExecutorConfig` (the executor's
  flags, vLLM's names: ``max_num_seqs``, ``num_kv_blocks``, ``enable_prefix_caching``,
  ``async_scheduling``, ...) and builds the engine exactly as ``pagedserve executor`` does
  (the model, its KV cache, the block-manager pool); :meth:`InProcessEngine.from_cli` takes
  the command-line flags instead. The block manager is the in-process one unless a client
  (or ``--blockmgr grpc``) is given. A :class:`LoadedModel` lets several engines, one after
  the other, share one loaded model and KV cache.
- **Requests.** :meth:`~InProcessEngine.generate` runs prompts (token ids, or text for the
  checkpoint's tokenizer) to their end and returns one :class:`RequestOutput` each;
  :meth:`~InProcessEngine.submit` queues one, :meth:`~InProcessEngine.step` runs one
  iteration and returns its :class:`StepOutput` s; :meth:`~InProcessEngine.abort` ends one.
  Refusals raise :class:`EngineError` with nothing queued.
- **Measuring.** :meth:`~InProcessEngine.stats` (the engine's counters),
  :meth:`~InProcessEngine.kv_usage` (the running sequences' block tables),
  :meth:`~InProcessEngine.kv_stats` (the block manager's view of the pool), and a
  ``runner_hook`` called around every forward of the model (:data:`RunnerHook`,
  :class:`ForwardInfo`).
- **The end.** :meth:`~InProcessEngine.close` (or leaving a ``with`` block) aborts what is
  left, frees every block and gives the pool back; :meth:`~InProcessEngine.kv_stats` then
  shows no block in use.

One thread drives an engine, as in the executor.
"""

from services.common.sampling_params import SamplingParams
from services.executor.api.engine import InProcessEngine, LoadedModel
from services.executor.api.types import (
    CompletionOutput,
    EngineStats,
    ForwardInfo,
    KVUsage,
    RequestOutput,
    RunnerHook,
    StepOutput,
)
from services.executor.core.outputs import EngineError, RequestErrorCode, TokenLogprob, Usage
from services.executor.core.sequence import FinishReason
from services.executor.model.prepack import PREPACK_ENV, PackedLinear
from services.executor.model.runner_config import available_cores
from services.executor.service.config import ExecutorConfig
from services.executor.service.lora_config import LoRAConfig, LoRAModulePath
from services.executor.service.startup import ServedModel

__all__ = [
    "PREPACK_ENV",
    "CompletionOutput",
    "EngineError",
    "EngineStats",
    "ExecutorConfig",
    "FinishReason",
    "ForwardInfo",
    "InProcessEngine",
    "KVUsage",
    "LoRAConfig",
    "LoRAModulePath",
    "LoadedModel",
    "PackedLinear",
    "RequestErrorCode",
    "RequestOutput",
    "RunnerHook",
    "SamplingParams",
    "ServedModel",
    "StepOutput",
    "TokenLogprob",
    "Usage",
    "available_cores",
]
