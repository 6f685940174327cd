"""``compose.yaml`` + ``Dockerfile``: their structure, and the services they declare, run.

Docker cannot run on the test machines (no engine, no GPU), so the stack test runs each
service's own ``command``, ``environment`` and ``healthcheck`` from compose.yaml as a local
process, rewriting only what Docker would provide (the full list with reasons is in
``tests/e2e/compose_runner.py``):

1. ``${VAR:-default}`` interpolation with only the required internal token exported: the
   defaults (``${VAR:?message}`` refuses to go on without the variable, as Compose does).
2. The image's ``pagedserve`` entrypoint -> ``python -m services.cli`` (this interpreter);
   the healthcheck's ``python`` -> this interpreter.
3. Service hostnames (``blockmgr:50052``, ``executor:50061``) -> ``127.0.0.1:<local port>``.
4. Container ports (50052, 50061, 50051, 9090, also in ``127.0.0.1:<port>`` healthchecks)
   -> free local ports.
5. Bind address ``0.0.0.0`` -> ``127.0.0.1``.
6. The mounted model path ``/models/model`` -> a tiny model written in tmp.
7. ``--device cuda`` -> ``--device cpu``; ``--gpu-memory-utilization`` dropped.
8. Environment: compose's ``environment`` (unset valueless keys left out), the image's
   offline/unbuffered ENV, no inherited ``PAGEDSERVE_*``, ``OMP_NUM_THREADS=1``.

What this cannot check: that the image builds, that the compose file passes ``docker compose
config``, GPU scheduling and the network isolation itself.
"""

from __future__ import annotations

import socket
import sys

import grpc
import pytest

from pagedserve.tools.tiny_model import write_tiny_model
from pagedserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.e2e.compose_runner import (
    DOCKERFILE,
    ComposeStack,
    bind_mounts,
    container_ports,
    depends_on,
    dockerfile_entrypoint,
    dockerfile_instructions,
    interpolate,
    load_compose,
    parse_duration,
    start_order,
)

MODEL_TARGET = "/models/model"
GATEWAY_PORT, METRICS_PORT, BLOCKMGR_PORT, EXECUTOR_PORT = 50051, 9090, 50052, 50061
HTTP_PORT = 8000
HEALTHCHECK_MODULE = "services.common.healthcheck"
SHELL = {"PAGEDSERVE_INTERNAL_TOKEN": "compose-test-token"}  # what `docker compose` sees


@pytest.fixture(scope="module")
def compose() -> dict:
    return interpolate(load_compose(), SHELL)


@pytest.fixture(scope="module")
def services(compose: dict) -> dict:
    return compose["services"]


def flag(command: list[str], name: str) -> list[str]:
    """Every value given to ``--name`` in an exec-form command."""
    return [command[i + 1] for i, a in enumerate(command[:-1]) if a == name]


# -- structure ---------------------------------------------------------------------------------


def test_three_services_from_the_one_dockerfile(services):
    assert set(services) == {"blockmgr", "executor", "gateway"}
    images = {s["image"] for s in services.values()}
    assert len(images) == 1, images
    for name, s in services.items():
        build = s["build"]
        context = build if isinstance(build, str) else build.get("context", ".")
        assert context == ".", name
        assert isinstance(s["command"], list), f"{name}: exec form, so no shell splits it"


def test_dockerfile_entrypoint_user_and_stub_generation():
    instructions = dockerfile_instructions()
    assert dockerfile_entrypoint() == ["pagedserve"]
    users = [args for word, args in instructions if word == "USER"]
    assert users and users[-1] not in ("root", "0"), "the image must not run as root"
    runs = " ".join(args for word, args in instructions if word == "RUN")
    assert "python -m pagedserve._protogen" in runs
    assert "pip install" in runs
    ignored = (DOCKERFILE.parent / ".dockerignore").read_text().split()
    for path in (".venv", "models", "**/__pycache__", "examples"):
        assert path in ignored


def test_gpu_reserved_for_the_executor_only(services):
    for name, s in services.items():
        devices = s.get("deploy", {}).get("resources", {}).get("reservations", {})
        devices = devices.get("devices", [])
        if name == "executor":
            assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
            assert flag(s["command"], "--device") == ["cuda"]
        else:
            assert devices == [], f"{name} must not reserve a GPU"


def test_only_the_gateway_is_published_and_the_backend_is_internal(compose, services):
    networks = compose["networks"]
    assert networks["backend"]["internal"] is True
    assert not (networks["frontend"] or {}).get("internal", False)
    assert sorted(services["blockmgr"]["networks"]) == ["backend"]
    assert sorted(services["executor"]["networks"]) == ["backend"]
    assert sorted(services["gateway"]["networks"]) == ["backend", "frontend"]
    for name in ("blockmgr", "executor"):
        assert not services[name].get("ports"), f"{name} must not publish ports"
    published = {int(str(p).rsplit(":", 1)[-1]) for p in services["gateway"]["ports"]}
    assert published == {GATEWAY_PORT, METRICS_PORT, HTTP_PORT}


def test_startup_order_waits_for_health(services):
    assert depends_on(services["blockmgr"]) == {}
    assert depends_on(services["executor"]) == {"blockmgr": "service_healthy"}
    assert depends_on(services["gateway"]) == {"executor": "service_healthy"}
    assert start_order(services) == ["blockmgr", "executor", "gateway"]
    own_port = {"blockmgr": BLOCKMGR_PORT, "executor": EXECUTOR_PORT, "gateway": GATEWAY_PORT}
    for name, s in services.items():
        test = s["healthcheck"]["test"]
        assert test == ["CMD", "python", "-m", HEALTHCHECK_MODULE, f"127.0.0.1:{own_port[name]}"]
        assert parse_duration(s["healthcheck"]["timeout"], 0) > 0
        assert own_port[name] in container_ports(s)


def test_commands_bind_all_interfaces_and_address_services_by_name(services):
    blockmgr, executor, gateway = (
        services[n]["command"] for n in ("blockmgr", "executor", "gateway")
    )
    for command in (blockmgr, executor, gateway):
        assert flag(command, "--host") == ["0.0.0.0"]
    assert flag(blockmgr, "--port") == [str(BLOCKMGR_PORT)]
    assert flag(executor, "--port") == [str(EXECUTOR_PORT)]
    assert flag(executor, "--blockmgr-address") == [f"blockmgr:{BLOCKMGR_PORT}"]
    assert flag(gateway, "--port") == [str(GATEWAY_PORT)]
    assert flag(gateway, "--metrics-port") == [str(METRICS_PORT)]
    assert flag(gateway, "--executor") == [f"executor:{EXECUTOR_PORT}"]


def test_model_mounted_read_only_where_the_commands_look(services):
    for name in ("executor", "gateway"):
        (mount,) = bind_mounts(services[name])
        assert mount["target"] == MODEL_TARGET and mount["read_only"] is True, name
        assert mount["source"] == "./models/tiny-llama"  # the default of PAGEDSERVE_MODEL_DIR
        assert flag(services[name]["command"], "--model") == [MODEL_TARGET]
    assert bind_mounts(services["blockmgr"]) == []


def test_model_dir_and_ports_follow_the_environment():
    raw = load_compose()
    env = {**SHELL, "PAGEDSERVE_MODEL_DIR": "/srv/llama", "PAGEDSERVE_PORT": "8443"}
    gateway = interpolate(raw, env)["services"]["gateway"]
    assert bind_mounts(gateway)[0]["source"] == "/srv/llama"
    assert f"8443:{GATEWAY_PORT}" in gateway["ports"]


def test_every_service_gets_the_one_required_internal_token():
    with pytest.raises(ValueError, match="PAGEDSERVE_INTERNAL_TOKEN"):
        interpolate(load_compose(), {})  # Compose refuses to start without it
    services = interpolate(load_compose(), SHELL)["services"]
    for name in ("blockmgr", "executor", "gateway"):
        assert services[name]["environment"]["PAGEDSERVE_INTERNAL_TOKEN"] == "compose-test-token"


# -- the rewrites ------------------------------------------------------------------------------


def test_rewritten_commands_keep_only_what_docker_does_not_provide(tmp_path):
    stack = ComposeStack({MODEL_TARGET: tmp_path / "model"}, shell_env=SHELL)
    bm, ex, gw = (stack.services[n] for n in ("blockmgr", "executor", "gateway"))
    head = [sys.executable, "-m", "services.cli"]
    p = stack.ports
    assert bm.argv == [
        *head,
        "blockmgr",
        "--host",
        "127.0.0.1",
        "--port",
        str(p["blockmgr"][BLOCKMGR_PORT]),
    ]
    assert ex.argv == [
        *head,
        "executor",
        "--model",
        str(tmp_path / "model"),
        "--host",
        "127.0.0.1",
        "--port",
        str(p["executor"][EXECUTOR_PORT]),
        "--blockmgr-address",
        f"127.0.0.1:{p['blockmgr'][BLOCKMGR_PORT]}",
        "--device",
        "cpu",
        "--dtype",
        "auto",
        "--async-scheduling",
    ]
    assert gw.argv == [
        *head,
        "gateway",
        "--model",
        str(tmp_path / "model"),
        "--host",
        "127.0.0.1",
        "--port",
        str(p["gateway"][GATEWAY_PORT]),
        "--metrics-port",
        str(p["gateway"][METRICS_PORT]),
        "--http-port",
        str(p["gateway"][HTTP_PORT]),
        "--executor",
        f"127.0.0.1:{p['executor'][EXECUTOR_PORT]}",
    ]
    assert gw.healthcheck == [
        sys.executable,
        "-m",
        HEALTHCHECK_MODULE,
        f"127.0.0.1:{p['gateway'][GATEWAY_PORT]}",
    ]
    assert "PAGEDSERVE_API_KEY" not in gw.env  # unset where "compose" runs: left out
    exported = ComposeStack(
        {MODEL_TARGET: tmp_path}, shell_env={**SHELL, "PAGEDSERVE_API_KEY": "k"}
    )
    assert exported.services["gateway"].env["PAGEDSERVE_API_KEY"] == "k"  # passed on when set
    local = {port for ports in p.values() for port in ports.values()}
    assert len(local) == 5  # each of the 5 container ports got its own local port


# -- the stack ---------------------------------------------------------------------------------


def test_compose_services_run_and_stream_a_generation(tmp_path):
    model = write_tiny_model(tmp_path / "model")
    stack = ComposeStack({MODEL_TARGET: model}, shell_env=SHELL, log_dir=tmp_path / "logs")
    with stack:
        stack.up(timeout=45)
        for name in stack.order:  # the declared healthchecks pass, in depends_on order
            assert stack.check_health(name), name
        request = generation_pb2.GenerateRequest(
            prompt="Hello",
            sampling_params=generation_pb2.SamplingParams(max_tokens=8, temperature=0),
        )
        with grpc.insecure_channel(stack.address("gateway", GATEWAY_PORT)) as channel:
            responses = list(
                generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=30)
            )
        codes = stack.down()
    final = responses[-1]
    assert final.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
    assert final.usage.completion_tokens > 0
    assert sum(len(r.token_ids) for r in responses) == final.usage.completion_tokens
    assert all(r.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED for r in responses[:-1])
    logs = {name: stack.services[name].log_tail() for name in stack.order}
    assert codes == {"gateway": 0, "executor": 0, "blockmgr": 0}, logs
    executor_log = [r.get("event") for r in stack.services["executor"].log_records()]
    assert "executor_ready" in executor_log


def test_healthcheck_fails_when_nothing_listens(tmp_path):
    stack = ComposeStack({MODEL_TARGET: tmp_path}, shell_env=SHELL)
    assert not stack.check_health("blockmgr")  # not started: connection refused, exit 1


def test_runner_rejects_unknown_mounts_and_shell_commands(tmp_path):
    raw = load_compose()
    with pytest.raises(ValueError, match="no local directory"):
        ComposeStack({}, compose=raw, shell_env=SHELL)
    broken = {
        **raw,
        "services": {
            **raw["services"],
            "blockmgr": {**raw["services"]["blockmgr"], "command": "blockmgr --port 1"},
        },
    }
    with pytest.raises(ValueError, match="exec"):
        ComposeStack({MODEL_TARGET: tmp_path}, compose=broken, shell_env=SHELL)


def test_durations():
    assert parse_duration("5s", 0) == 5
    assert parse_duration("1m30s", 0) == 90
    assert parse_duration("15m", 0) == 900
    assert parse_duration(None, 7) == 7
    with pytest.raises(ValueError):
        parse_duration("5 seconds", 0)


def test_a_port_taken_after_it_was_found_free_starts_the_stack_again_on_new_ports(tmp_path):
    """Another process binds the executor's port between the pick and its start (a busy
    machine): the executor refuses it, naming the flag, and the stack starts again on new
    ports instead of failing."""
    model = write_tiny_model(tmp_path / "model")
    stack = ComposeStack({MODEL_TARGET: model}, shell_env=SHELL, log_dir=tmp_path / "logs")
    taken = stack.ports["executor"][EXECUTOR_PORT]
    with socket.socket() as squatter, stack:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        stack.up(timeout=45)
        assert stack.ports["executor"][EXECUTOR_PORT] != taken
        assert all(stack.check_health(name) for name in stack.order)
