"""SMG's engine gRPC (``vllm.grpc.engine.VllmEngine``, the router's proto from the pinned
``smg-grpc-proto`` package) served by a real executor process, driven by that package's
client: a streamed greedy generation equals HF's, ``n`` samples each complete once, an
aborted and a cancelled stream free their blocks, loads and model info are reported, the
tokenizer comes as a zip whose SHA-256 checks and which tokenizes as HF does, the KV events
carry each stored block's token ids and resume from a cursor, and bad input is
INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import hashlib
import io
import zipfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2 as smg_common
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from pagedserve.testing.procs import ServiceProcess, wait_until
from services.blockmgr.api.hashing import ROOT_HASH, hash_block
from services.executor.service.smg_kv_events import smg_block_hash
from tests.gateway.conftest import stack_executor_args

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def stub(tiny_model_dir: Path) -> Iterator[pb_grpc.VllmEngineStub]:
    executor = ServiceProcess(stack_executor_args(tiny_model_dir), "executor_ready")
    channel = grpc.insecure_channel(executor.address)
    yield pb_grpc.VllmEngineStub(channel)
    channel.close()
    assert executor.stop() == 0


def generate(ids: list[int], max_tokens: int, **params: object) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(temperature=0, max_tokens=max_tokens, **params)  # type: ignore[arg-type]
    return pb.GenerateRequest(
        request_id=f"r-{len(ids)}-{max_tokens}-{sorted(params.items())}",
        tokenized=pb.TokenizedInput(input_ids=ids),
        sampling_params=sampling,
        stream=True,
    )


def idle(stub: pb_grpc.VllmEngineStub) -> None:
    """Nothing running and every KV block free (the engine's load once idle)."""

    def settled() -> bool:
        load = stub.GetLoads(pb.GetLoadsRequest(), timeout=10).loads[0]
        return load.num_total_reqs == 0 and load.token_usage == 0.0

    wait_until(settled, what="every block free")


def test_streamed_greedy_generation_equals_hf(stub, tokenizer, hf_greedy) -> None:
    ids = tokenizer(PROMPT).input_ids
    responses = list(stub.Generate(generate(ids, 12, ignore_eos=True), timeout=60))
    chunks = [r.chunk for r in responses if r.HasField("chunk")]
    (done,) = [r.complete for r in responses if r.HasField("complete")]
    assert [t for c in chunks for t in c.token_ids] == list(done.output_ids) == hf_greedy(ids, 12)
    assert done.finish_reason == "length" and done.prompt_tokens == len(ids)
    assert done.completion_tokens == 12 and chunks[-1].completion_tokens == 12
    assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=10).healthy
    idle(stub)


def test_each_of_n_samples_completes_once(stub, tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer(PROMPT).input_ids
    request = generate(ids, 5, n=3, ignore_eos=True)
    request.sampling_params.temperature = 1.0
    request.sampling_params.seed = 7
    done = [r.complete for r in stub.Generate(request, timeout=60) if r.HasField("complete")]
    assert sorted(d.index for d in done) == [0, 1, 2]
    assert all(len(d.output_ids) == 5 for d in done)


def test_abort_and_cancel_end_the_request_and_free_its_blocks(stub, tokenizer) -> None:
    ids = tokenizer(PROMPT).input_ids
    request = generate(ids, 400, ignore_eos=True)
    stream = stub.Generate(request, timeout=120)
    first = next(stream)
    assert first.HasField("chunk")
    stub.Abort(pb.AbortRequest(request_ids=[request.request_id]), timeout=10)
    rest = list(stream)
    assert rest[-1].HasField("complete") and rest[-1].complete.finish_reason == "abort"
    idle(stub)
    cancelled = stub.Generate(generate(ids, 399, ignore_eos=True), timeout=120)
    next(cancelled)
    cancelled.cancel()
    idle(stub)


def test_loads_model_info_and_server_info(stub) -> None:
    loads = stub.GetLoads(pb.GetLoadsRequest(), timeout=10)
    assert loads.dp_rank_count == 1 and loads.loads[0].dp_rank == 0
    assert loads.loads[0].max_total_num_tokens == 255 * 16  # --num-kv-blocks 256
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.is_generation and info.max_context_length == 512 and info.vocab_size > 0
    assert info.model_type == "llama" and list(info.architectures) == ["LlamaForCausalLM"]
    server = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert server.data_parallel_size == 1 and server.uptime_seconds > 0


def test_the_tokenizer_comes_as_a_zip_whose_sha256_checks(stub, tokenizer, tmp_path) -> None:
    chunks = list(stub.GetTokenizer(smg_common.GetTokenizerRequest(), timeout=30))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        zf.extractall(tmp_path)
    remote = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    text = "Hello, world! 12 tabs\tand spaces"
    assert (
        remote(text, add_special_tokens=False).input_ids
        == tokenizer(text, add_special_tokens=False).input_ids
    )


def _stored_runs(batches: Iterator[smg_common.KvEventBatch], want: int) -> list:
    """Read ``batches`` until a stored run of ``want`` blocks from the root arrives; every
    stored run (its batch's sequence number, parent hash or None, its blocks) so far."""
    runs = []
    for batch in batches:
        for event in batch.events:
            if event.HasField("stored"):
                stored = event.stored
                parent = stored.parent_block_hash if stored.HasField("parent_block_hash") else None
                runs.append((batch.sequence_number, parent, list(stored.blocks)))
                if parent is None and len(stored.blocks) >= want:
                    return runs
    raise AssertionError(f"the stream ended before a run of {want} blocks: {runs}")


def test_kv_events_carry_each_stored_blocks_tokens_and_resume_from_a_cursor(stub) -> None:
    ids = [7 + (i * 13) % 480 for i in range(50)]  # 3 full blocks of 16, then 2 tokens
    events = stub.SubscribeKvEvents(smg_common.SubscribeKvEventsRequest(), timeout=60)
    done = [r for r in stub.Generate(generate(ids, 1), timeout=60) if r.HasField("complete")]
    assert len(done) == 1
    runs = _stored_runs(events, 3)
    events.cancel()
    seq, parent, blocks = runs[-1]
    assert parent is None and [b.block_size for b in blocks] == [16] * len(blocks)
    assert [list(b.token_ids) for b in blocks[:3]] == [ids[0:16], ids[16:32], ids[32:48]]
    parent = ROOT_HASH  # the token ids re-hash to the blocks the executor served
    for block in blocks[:3]:
        parent = hash_block(parent, list(block.token_ids))
        assert block.block_hash == smg_block_hash(parent)
    assert len({b.block_hash for b in blocks}) == len(blocks)
    assert all(b.cache_level == 0 for b in blocks)  # on the device
    # From a cursor: the same run again first, in the batch of that number
    again = stub.SubscribeKvEvents(
        smg_common.SubscribeKvEventsRequest(start_sequence_number=seq), timeout=60
    )
    first_seq, first_parent, first_blocks = _stored_runs(again, 3)[0]
    again.cancel()
    assert first_seq == seq and first_parent is None
    assert [b.block_hash for b in first_blocks] == [b.block_hash for b in blocks]
    idle(stub)


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (pb.GenerateRequest(request_id="t", text="hi"), "input"),
        (
            pb.GenerateRequest(
                request_id="p",
                tokenized=pb.TokenizedInput(input_ids=[1, 2]),
                sampling_params=pb.SamplingParams(max_tokens=2, prompt_logprobs=1),
            ),
            "sampling_params.prompt_logprobs",
        ),
        (
            pb.GenerateRequest(
                request_id="v",
                tokenized=pb.TokenizedInput(input_ids=[1, 10**6]),
                sampling_params=pb.SamplingParams(max_tokens=2),
            ),
            "tokenized.input_ids",
        ),
    ],
)
def test_bad_requests_are_invalid_argument_naming_the_field(stub, request_, field) -> None:
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request_, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field), err.value.details()
