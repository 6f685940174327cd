"""Run the services of ``compose.yaml`` as local processes, the way Docker would run them.

Docker cannot run here (no engine, no GPU), so this module takes each service's ``command``
(after the Dockerfile's ``ENTRYPOINT``), its ``environment`` and its ``healthcheck`` from the
compose file and rewrites ONLY what Docker itself would provide:

1. Variables: ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}`` and ``$$`` are interpolated
   against ``shell_env`` (default: empty), i.e. as ``docker compose`` does when none of the
   settings is exported: every ``${VAR:-default}`` takes its default.
2. Entrypoint: the image's ``pagedserve`` console script becomes ``python -m services.cli``
   with this interpreter (same code, this virtualenv), run from the repository root; a
   healthcheck's ``python`` becomes this interpreter too.
3. Hostnames: ``<service>:<port>`` (Docker's DNS on the compose network) becomes
   ``127.0.0.1:<local port>`` of that service.
4. Ports: every container port of a service (its ``expose`` and ``ports`` targets) gets a free
   local port: each container has its own network namespace, processes on one host do not.
   A token equal to one of the service's own container ports, or ``127.0.0.1:<port>`` /
   ``localhost:<port>`` (healthchecks run inside the container), is rewritten.
5. Bind address: ``0.0.0.0`` becomes ``127.0.0.1``: in Docker the container's namespace keeps
   the socket private (only ``ports`` are published); here it would listen on every interface
   of the test machine.
6. Mounts: a token equal to (or under) a bind mount's ``target`` becomes the local directory
   given for that target (the tiny model instead of ``/models/model``).
7. GPU: ``--device cuda`` becomes ``--device cpu`` and ``--gpu-memory-utilization V`` is
   dropped (a GPU-only setting); ``deploy.resources`` reservations are not applied.
8. Environment: the compose ``environment`` entries (a key without a value is taken from
   ``shell_env`` or left out, as Compose does), over this process's environment less any
   ``PAGEDSERVE_*`` variable (a developer's own settings must not leak in), plus what the
   image's ``ENV`` sets that matters here (offline Hugging Face, unbuffered Python) and
   ``OMP_NUM_THREADS=1`` (2-core test machines).

Services start in ``depends_on`` order; each must pass its own compose healthcheck (run as
declared, with the rewrites above, every ``poll_s`` seconds and with the declared
``timeout``) before the services that depend on it start. :meth:`ComposeStack.down` stops
them with SIGTERM in reverse order and returns their exit codes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "compose.yaml"
DOCKERFILE = ROOT / "Dockerfile"

LOCAL_HOST = "127.0.0.1"
# Rewrite 7: flags that only mean something on a GPU, with the number of values each takes.
GPU_ONLY_FLAGS = {"--gpu-memory-utilization": 1}
# Rewrite 8: what the image's ENV provides that matters outside the image.
IMAGE_ENV = {"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
TEST_ENV = {"OMP_NUM_THREADS": "1"}

_VAR = re.compile(
    r"\$(?:\$|\{(?P<braced>[A-Za-z_]\w*)(?P<op>:?[-?])?(?P<default>[^}]*)\}"
    r"|(?P<plain>[A-Za-z_]\w*))"
)


def load_compose(path: Path = COMPOSE_FILE) -> dict[str, Any]:
    with open(path) as f:
        return yaml.safe_load(f)


def dockerfile_instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs of a Dockerfile, continuation lines joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def dockerfile_entrypoint(path: Path = DOCKERFILE) -> list[str]:
    """The image's ENTRYPOINT (exec form); the last one wins, as in Docker."""
    entries = [
        json.loads(args) for word, args in dockerfile_instructions(path) if word == "ENTRYPOINT"
    ]
    if not entries:
        raise ValueError(f"{path} has no ENTRYPOINT")
    return entries[-1]


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Compose variable interpolation of every string in ``value`` (rewrite 1)."""
    if isinstance(value, str):

        def sub(m: re.Match[str]) -> str:
            if m.group(0) == "$$":
                return "$"
            name = m.group("braced") or m.group("plain")
            op, default = m.group("op"), m.group("default") or ""
            if op == ":-":
                return env.get(name) or default
            if op == "-":
                return env.get(name, default)
            if op is not None and op.endswith("?"):  # required: as Compose, refuse to go on
                value = env.get(name)
                if value is None or (op == ":?" and not value):
                    raise ValueError(f"required variable {name} is missing a value: {default}")
                return value
            return env.get(name, "")

        return _VAR.sub(sub, value)
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


def parse_duration(text: str | int | float | None, default: float) -> float:
    """Compose durations: ``"5s"``, ``"1m30s"``, ``"15m"``, ``"500ms"``."""
    if text is None:
        return default
    if isinstance(text, int | float):
        return float(text)
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a compose duration: {text!r}")
    return sum(float(n) * units[u] for n, u in parts)


def start_order(services: Mapping[str, Any]) -> list[str]:
    """Service names with every ``depends_on`` before its dependents (file order otherwise)."""
    order: list[str] = []
    visiting: set[str] = set()

    def visit(name: str) -> None:
        if name in order:
            return
        if name in visiting:
            raise ValueError(f"depends_on cycle through {name!r}")
        visiting.add(name)
        for dep in depends_on(services[name]):
            visit(dep)
        visiting.discard(name)
        order.append(name)

    for name in services:
        visit(name)
    return order


def depends_on(service: Mapping[str, Any]) -> dict[str, str]:
    """``depends_on`` as {service: condition}; the short (list) form means service_started."""
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):
        return dict.fromkeys(deps, "service_started")
    return {name: (spec or {}).get("condition", "service_started") for name, spec in deps.items()}


def container_ports(service: Mapping[str, Any]) -> list[int]:
    """Ports the service listens on inside its container: ``expose`` plus ``ports`` targets."""
    ports = [int(str(p).split("/")[0]) for p in service.get("expose") or []]
    for p in service.get("ports") or []:
        if isinstance(p, dict):
            target = int(p["target"])
        else:  # "[host_ip:][published:]target[/proto]"
            target = int(str(p).split("/")[0].rsplit(":", 1)[-1])
        ports.append(target)
    return sorted(set(ports))


def bind_mounts(service: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Bind mounts in long form ({source, target, read_only}), short syntax normalised."""
    out = []
    for v in service.get("volumes") or []:
        if isinstance(v, dict):
            if v.get("type", "volume") == "bind":
                out.append(v)
            continue
        source, target, *opts = str(v).split(":")
        out.append(
            {
                "type": "bind",
                "source": source,
                "target": target,
                "read_only": "ro" in (opts[0].split(",") if opts else []),
            }
        )
    return out


def environment(service: Mapping[str, Any], shell_env: Mapping[str, str]) -> dict[str, str]:
    """The service's ``environment`` (map or list form); valueless keys come from the shell."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(e.split("=", 1) if "=" in e else (e, None) for e in env)
    out: dict[str, str] = {}
    for key, value in env.items():
        if value is None:
            if key in shell_env:
                out[key] = shell_env[key]
        else:
            out[key] = str(value)
    return out


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((LOCAL_HOST, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class LocalService:
    """One compose service, rewritten to run here."""

    name: str
    argv: list[str]  # the full command line: entrypoint + command
    env: dict[str, str]  # only the variables set on top of the inherited environment
    healthcheck: list[str] | None  # the healthcheck command line, or None
    health_timeout: float
    ports: dict[int, int]  # container port -> local port
    log_path: Path | None = None
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def log_tail(self, n: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def log_records(self) -> list[dict[str, Any]]:
        records = []
        if self.log_path is not None and self.log_path.exists():
            for line in self.log_path.read_text(errors="replace").splitlines():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    records.append({"event": "raw", "line": line})
        return records


class ComposeStack:
    """The compose services as local processes (see the module docstring for the rewrites).

    ``mounts`` maps a bind mount's container ``target`` to the local directory to use.
    """

    def __init__(
        self,
        mounts: Mapping[str, Path],
        *,
        compose: Mapping[str, Any] | None = None,
        entrypoint: list[str] | None = None,
        shell_env: Mapping[str, str] | None = None,
        log_dir: Path | None = None,
        poll_s: float = 0.25,
    ) -> None:
        self.shell_env = dict(shell_env or {})
        raw = dict(compose) if compose is not None else load_compose()
        self.compose: dict[str, Any] = interpolate(raw, self.shell_env)
        self.entrypoint = entrypoint if entrypoint is not None else dockerfile_entrypoint()
        self.mounts = {target: Path(local) for target, local in mounts.items()}
        self.log_dir = log_dir
        self.poll_s = poll_s
        services = self.compose["services"]
        self.order = start_order(services)
        self._assign_ports()

    def _assign_ports(self) -> None:
        """Free local ports for every container port, and the services' plans over them."""
        services = self.compose["services"]
        all_ports = {name: container_ports(services[name]) for name in self.order}
        locals_ = iter(free_ports(sum(len(p) for p in all_ports.values())))
        self.ports = {name: {p: next(locals_) for p in ports} for name, ports in all_ports.items()}
        self.services = {name: self._plan(name, services[name]) for name in self.order}

    # -- the rewrites ------------------------------------------------------------------------

    def _entrypoint(self) -> list[str]:
        if self.entrypoint != ["pagedserve"]:
            raise ValueError(f"unexpected ENTRYPOINT {self.entrypoint}: update the rewrite")
        return [sys.executable, "-m", "services.cli"]  # rewrite 2

    def _token(self, name: str, token: str) -> str:
        own = self.ports[name]
        if token == "0.0.0.0":  # rewrite 5
            return LOCAL_HOST
        if token.isdigit() and int(token) in own:  # rewrite 4
            return str(own[int(token)])
        host, sep, port = token.rpartition(":")
        if sep and port.isdigit():
            if host in self.ports and int(port) in self.ports[host]:  # rewrite 3
                return f"{LOCAL_HOST}:{self.ports[host][int(port)]}"
            if host in (LOCAL_HOST, "localhost") and int(port) in own:  # rewrite 4
                return f"{LOCAL_HOST}:{own[int(port)]}"
        for target, local in self.mounts.items():  # rewrite 6
            if token == target or token.startswith(target.rstrip("/") + "/"):
                return str(local) + token[len(target.rstrip("/")) :]
        return token

    def _command(self, name: str, args: list[str]) -> list[str]:
        out: list[str] = []
        i = 0
        while i < len(args):
            arg = args[i]
            if arg in GPU_ONLY_FLAGS:  # rewrite 7
                i += 1 + GPU_ONLY_FLAGS[arg]
                continue
            if arg == "--device" and i + 1 < len(args) and args[i + 1] == "cuda":  # rewrite 7
                out += ["--device", "cpu"]
                i += 2
                continue
            if arg.startswith("--device=cuda"):
                out.append("--device=cpu")
                i += 1
                continue
            out.append(self._token(name, arg))
            i += 1
        return out

    def _plan(self, name: str, service: Mapping[str, Any]) -> LocalService:
        command = service.get("command")
        if not isinstance(command, list):
            raise ValueError(f"{name}: command must be in exec (list) form, got {command!r}")
        for mount in bind_mounts(service):
            if mount["target"] not in self.mounts:
                raise ValueError(f"{name}: no local directory for mount {mount['target']!r}")
        healthcheck = None
        hc = service.get("healthcheck") or {}
        if hc and not hc.get("disable"):
            test = hc.get("test")
            if not (isinstance(test, list) and test and test[0] == "CMD"):
                raise ValueError(f"{name}: healthcheck.test must be a CMD list, got {test!r}")
            argv = [str(a) for a in test[1:]]
            if argv[0] == "python":  # rewrite 2
                argv[0] = sys.executable
            healthcheck = [argv[0], *[self._token(name, a) for a in argv[1:]]]
        return LocalService(
            name=name,
            argv=[*self._entrypoint(), *self._command(name, [str(a) for a in command])],
            env={**IMAGE_ENV, **TEST_ENV, **environment(service, self.shell_env)},  # rewrite 8
            healthcheck=healthcheck,
            health_timeout=parse_duration(hc.get("timeout"), 30.0),
            ports=self.ports[name],
        )

    # -- running -----------------------------------------------------------------------------

    def _child_env(self, service: LocalService) -> dict[str, str]:
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
        return {**inherited, **service.env}

    def up(self, timeout: float = 60.0, attempts: int = 3) -> None:
        """Start every service in order; each must pass its healthcheck within ``timeout``.
        A service refused a port another process took since it was found free (a busy
        machine's race) starts the stack again on new ports, up to ``attempts`` times."""
        for attempt in range(1, attempts + 1):
            try:
                self._up(timeout)
                return
            except RuntimeError:
                lost = any(
                    r.get("error") == "PortInUseError"
                    for service in self.services.values()
                    for r in service.log_records()
                )
                if not lost or attempt == attempts:
                    raise
                self._assign_ports()

    def _up(self, timeout: float) -> None:
        try:
            for name in self.order:
                for dep, condition in depends_on(self.compose["services"][name]).items():
                    if condition == "service_healthy" and self.services[dep].healthcheck is None:
                        raise ValueError(f"{name} waits for {dep} to be healthy: no healthcheck")
                self._start(self.services[name])
                self.wait_healthy(name, timeout)
        except BaseException:
            self.down()
            raise

    def _start(self, service: LocalService) -> None:
        log = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            service.log_path = self.log_dir / f"{service.name}.log"
            log = open(service.log_path, "wb")  # noqa: SIM115 - the child keeps it open
        try:
            service.proc = subprocess.Popen(
                service.argv,
                cwd=ROOT,
                env=self._child_env(service),
                stdin=subprocess.DEVNULL,
                stdout=log or subprocess.DEVNULL,
                stderr=subprocess.STDOUT if log else subprocess.DEVNULL,
            )
        finally:
            if log is not None:
                log.close()

    def check_health(self, name: str) -> bool:
        """Run the service's compose healthcheck once; True iff it exits 0."""
        service = self.services[name]
        assert service.healthcheck is not None
        try:
            result = subprocess.run(
                service.healthcheck,
                cwd=ROOT,
                env=self._child_env(service),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=service.health_timeout,
            )
        except subprocess.TimeoutExpired:
            return False
        return result.returncode == 0

    def wait_healthy(self, name: str, timeout: float) -> None:
        service = self.services[name]
        if service.healthcheck is None:
            return
        deadline = time.monotonic() + timeout
        while True:
            assert service.proc is not None
            if service.proc.poll() is not None:
                raise RuntimeError(
                    f"{name} exited with {service.proc.returncode} before it was "
                    f"healthy:\n{service.log_tail()}"
                )
            if self.check_health(name):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{name} not healthy after {timeout:.0f}s:\n{service.log_tail()}"
                )
            time.sleep(self.poll_s)

    def down(self, timeout: float = 30.0) -> dict[str, int | None]:
        """SIGTERM every running service, dependents first; their exit codes (None: killed)."""
        codes: dict[str, int | None] = {}
        for name in reversed(self.order):
            proc = self.services[name].proc
            if proc is None:
                continue
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                    codes[name] = None
                    continue
            codes[name] = proc.returncode
        return codes

    def address(self, name: str, container_port: int) -> str:
        return f"{LOCAL_HOST}:{self.ports[name][container_port]}"

    def __enter__(self) -> ComposeStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()
