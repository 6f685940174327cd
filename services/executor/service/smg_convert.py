"""Conversions between SMG's engine proto (``vllm.grpc.engine``, from the pinned
``smg-grpc-proto`` package) and the executor's domain types: sampling parameters in, token
chunks, completions, loads and model info out. Pure: no gRPC calls, no engine state."""

from __future__ import annotations

import datetime
import hashlib
import io
import json
import zipfile
from pathlib import Path

from smg_grpc_proto.generated import common_pb2 as smg_common
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from services.common.limits import FieldError
from services.common.sampling_params import SamplingParams
from services.common.structured_outputs import StructuredKind, StructuredOutputs
from services.executor.core.outputs import TokenLogprob
from services.executor.core.sequence import FinishReason
from services.executor.service.commands import Load

__all__ = [
    "FINISH_NAMES",
    "loads_pb",
    "output_logprobs",
    "params_from_smg",
    "tokenizer_chunks",
]

FINISH_NAMES = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}  # else "abort"
# The files a remote tokenizer is built from (those the checkpoint has).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
    "config.json",
)
CHUNK_BYTES = 1 << 20

_CONSTRAINTS = {
    "json_schema": StructuredKind.JSON,
    "regex": StructuredKind.REGEX,
    "grammar": StructuredKind.GRAMMAR,
}


def params_from_smg(p: pb.SamplingParams, vocab_size: int) -> SamplingParams:
    """The engine's sampling parameters of SMG's (vLLM's semantics: an unset or zero field
    is vLLM's default). Raises :class:`FieldError` naming ``sampling_params.<field>`` for
    what cannot be served. ``stop`` strings, ``skip_special_tokens`` and the other
    detokenization options are the router's: SMG detokenizes and matches stop strings
    itself, so they are not read here."""
    try:
        if p.HasField("prompt_logprobs"):
            raise FieldError("prompt_logprobs", "is not served over this API yet")
        if p.HasField("truncate_prompt_tokens"):
            raise FieldError("truncate_prompt_tokens", "is not served: send the prompt to use")
        if p.HasField("logprobs") and p.logprobs < 0:
            raise FieldError("logprobs", "-1 (the whole vocabulary) is not served; at most 20")
        kind = p.WhichOneof("constraint")
        structured = None
        if kind in _CONSTRAINTS:
            structured = StructuredOutputs(_CONSTRAINTS[kind], getattr(p, kind))
        elif kind == "json_object" and p.json_object:
            structured = StructuredOutputs(StructuredKind.JSON_OBJECT)
        elif kind == "choice":
            structured = StructuredOutputs(StructuredKind.CHOICE, choices=tuple(p.choice.choices))
        elif kind == "structural_tag":
            raise FieldError("structural_tag", "is not served")
        params = SamplingParams(
            n=p.n or 1,
            temperature=p.temperature if p.HasField("temperature") else 1.0,
            top_p=p.top_p or 1.0,
            top_k=p.top_k or -1,
            min_p=p.min_p,
            seed=p.seed if p.HasField("seed") else None,
            max_tokens=p.max_tokens if p.HasField("max_tokens") else 16,
            min_tokens=p.min_tokens,
            stop_token_ids=tuple(p.stop_token_ids),
            ignore_eos=p.ignore_eos,
            repetition_penalty=p.repetition_penalty or 1.0,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            logprobs=p.logprobs if p.HasField("logprobs") else None,
            structured_outputs=structured,
            logit_bias=tuple(sorted((int(t), float(b)) for t, b in p.logit_bias.items())),
        )
        params.validate(vocab_size)
    except FieldError as exc:
        raise exc.under("sampling_params") from None
    return params


def output_logprobs(logprobs: list[TokenLogprob]) -> pb.OutputLogProbs:
    return pb.OutputLogProbs(
        token_logprobs=[lp.logprob for lp in logprobs],
        token_ids=[lp.token_id for lp in logprobs],
        top_logprobs=[
            pb.TopLogProbs(values=[v for _, v in lp.top], token_ids=[t for t, _ in lp.top])
            for lp in logprobs
        ],
    )


def loads_pb(
    load: Load, kv_capacity_tokens: int, max_num_seqs: int, version: str
) -> pb.GetLoadsResponse:
    """One scheduler load (this executor is one data-parallel rank)."""
    usable = max(1, load.num_usable_blocks)
    prompt = load.num_prompt_tokens + load.num_cached_prompt_tokens
    rank = pb.SchedulerLoad(
        dp_rank=0,
        num_running_reqs=load.num_running,
        num_waiting_reqs=load.num_waiting,
        num_total_reqs=load.num_running + load.num_waiting,
        num_used_tokens=load.num_running_tokens,
        max_total_num_tokens=kv_capacity_tokens,
        token_usage=1.0 - load.num_free_blocks / usable,
        cache_hit_rate=load.num_cached_prompt_tokens / prompt if prompt else 0.0,
        max_running_requests=max_num_seqs,
    )
    now = datetime.datetime.now(datetime.UTC).isoformat()
    return pb.GetLoadsResponse(timestamp=now, version=version, dp_rank_count=1, loads=[rank])


def tokenizer_chunks(model_dir: str | Path) -> list[smg_common.GetTokenizerChunk]:
    """The checkpoint's tokenizer files as one zip, cut into chunks; the last carries the
    zip's SHA-256 (hex)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in TOKENIZER_FILES:
            path = Path(model_dir) / name
            if path.is_file():
                zf.write(path, name)
    data = buf.getvalue()
    digest = hashlib.sha256(data).hexdigest()
    parts = [data[i : i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)] or [b""]
    chunks = [smg_common.GetTokenizerChunk(data=part) for part in parts]
    chunks[-1].sha256 = digest
    return chunks


def model_type_and_architectures(model_dir: str | Path) -> tuple[str, list[str]]:
    """``config.json``'s ``model_type`` and ``architectures``."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return "", []
    return str(config.get("model_type", "")), [str(a) for a in config.get("architectures", [])]
