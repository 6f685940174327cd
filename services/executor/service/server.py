"""The executor process: gRPC server first (health NOT_SERVING), then the model load and KV
sizing in a worker thread, then the engine loop; SERVING once it runs and the block manager
answers."""

from __future__ import annotations

import asyncio

import structlog
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as smg_grpc

from pagedserve.v1 import executor_pb2, executor_pb2_grpc
from services.common.bootstrap import InternalServer
from services.common.gc_policy import freeze_startup_heap
from services.common.grpc_server import set_serving, stop_event
from services.executor.service.config import ExecutorConfig
from services.executor.service.engine_loop import EngineLoop
from services.executor.service.servicer import ExecutorServicer
from services.executor.service.smg_servicer import SmgEngineServicer

log = structlog.get_logger(__name__)
SERVICE_NAME = executor_pb2.DESCRIPTOR.services_by_name["Executor"].full_name
GRACE_PERIOD_S = 5.0
LOST_RANK_GRACE_S = 0.5


async def serve(config: ExecutorConfig) -> int:
    """Run until SIGTERM/SIGINT (exit 0) or until the engine dies (exit 1)."""
    aio_loop = asyncio.get_running_loop()
    servicer = ExecutorServicer()
    internal = InternalServer(config.security, SERVICE_NAME, config.host, config.port)
    server, health_servicer = internal.server, internal.health
    executor_pb2_grpc.add_ExecutorServicer_to_server(servicer, server)
    smg = SmgEngineServicer()  # SMG's engine proto, for its router (smg_servicer)
    smg_grpc.add_VllmEngineServicer_to_server(smg, server)
    internal.bind()

    async def set_health(serving: bool) -> None:
        await set_serving(health_servicer, SERVICE_NAME, serving)

    await set_health(False)
    await internal.start(log, "executor_listening")

    stop = stop_event()

    def on_health(healthy: bool) -> None:  # called from the engine thread
        log.info("executor_health", serving=healthy)
        aio_loop.call_soon_threadsafe(lambda: asyncio.ensure_future(set_health(healthy)))

    from services.executor.model.runner import ModelRunner
    from services.executor.service.startup import build_engine

    load = asyncio.ensure_future(asyncio.to_thread(build_engine, config, on_health=on_health))
    done, _ = await asyncio.wait(
        {load, asyncio.ensure_future(stop.wait())}, return_when=asyncio.FIRST_COMPLETED
    )
    if load not in done:  # stopped while loading
        await server.stop(0)
        return 0
    engine, served = load.result()
    engine_loop = EngineLoop(engine, max_seqs_per_session=config.max_seqs_per_session)
    runner = engine.runner if isinstance(engine.runner, ModelRunner) else None
    workers = runner.workers if runner is not None else None
    if workers is not None:

        def on_worker_lost(exc: BaseException) -> None:  # the watcher thread
            on_health(False)
            engine_loop.fail(exc)

        workers.watch(on_worker_lost)
    engine_loop.start()
    servicer.ready(engine_loop, served)
    smg.ready(engine_loop, served, config.model)
    log.info("gc_frozen", objects=freeze_startup_heap())
    await set_health(engine.link.healthy)
    log.info(
        "executor_ready",
        model=served.name,
        max_model_len=served.max_model_len,
        num_kv_blocks=served.num_kv_blocks,
        device=served.device,
    )

    code = 0
    lost_at: float | None = None
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), timeout=0.5)
        except TimeoutError:
            if not engine_loop.alive:
                log.error("engine_loop_died", error=repr(engine_loop.error))
                code = 1
                break
            if workers is not None and workers.lost is not None:
                # The engine thread ends every stream (UNAVAILABLE) at its next step boundary;
                # one stuck in a collective that never returns is not waited for long.
                lost_at = lost_at or aio_loop.time()
                if aio_loop.time() - lost_at > LOST_RANK_GRACE_S:
                    log.error(
                        "engine_stuck_after_rank_lost",
                        error=str(workers.lost),
                        engine_stack=engine_loop.stack(),
                    )
                    code = 1
                    break
    log.info("executor_shutting_down")
    await health_servicer.enter_graceful_shutdown()
    # A dead engine serves nothing: do not hold its health watchers for the grace period.
    await server.stop(GRACE_PERIOD_S if code == 0 else 0.5)
    engine_loop.stop(timeout=10.0 if lost_at is None else 1.0)  # a stuck one is not waited for
    if runner is not None:
        runner.close()
    engine.link.unregister()
    engine.link.close()
    log.info("executor_stopped")
    return code
