"""The serving process as the launcher sees it: started, waited for, asked over HTTP, killed."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

from coldsnap.agent.client import AgentClient, AgentError
from coldsnap.agent.protocol import CONTROL_ENV, StatusReply
from coldsnap.snapshot.process_tree import kill_tree

__all__ = ["EngineProcess", "ServingTree", "LaunchError", "AgentMissing", "wait_for_agent", "wait_for_http", "http_status",
           "new_control_name", "post_json"]


class LaunchError(RuntimeError):
    """The serving process did not come up (exited, or not ready in time)."""


class AgentMissing(LaunchError):
    """The serving process answers HTTP, but no coldsnap agent answered: it runs without coldsnap."""


def new_control_name() -> str:
    """An abstract unix socket name: restored by CRIU with the process, no file left behind."""
    return f"@coldsnap-agent-{uuid.uuid4().hex[:16]}"


def wait_for_agent(control: str, alive: Callable[[], bool], timeout: float, http_port: int | None = None,
                   agent_after_http: float = 60.0, on_http: Callable[[], None] | None = None) -> StatusReply:
    """Poll the agent's status until it answers (or the process dies, or time runs out). With ``http_port``,
    poll that port too: an engine starts its agent while it loads the model, before its HTTP server, so a
    port that answers HTTP while no agent has for ``agent_after_http`` seconds is an engine running
    without coldsnap (:class:`AgentMissing`); ``on_http`` is called once, when the port first answers."""
    deadline = time.monotonic() + timeout
    http_since: float | None = None
    while True:
        try:
            return AgentClient(control, timeout=30).status()
        except (OSError, AgentError):
            if not alive():
                raise LaunchError("the serving process exited before its coldsnap agent answered") from None
            now = time.monotonic()
            if http_port is not None and http_since is None and http_status(http_port) is not None:
                http_since = now
                if on_http is not None:
                    on_http()
            if http_since is not None and now - http_since > agent_after_http:
                raise AgentMissing(f"port {http_port} answers HTTP, but no coldsnap agent answered at {control} "
                                   f"within {agent_after_http:.0f} s of it") from None
            if now > deadline:
                raise LaunchError(f"no coldsnap agent answered at {control} within {timeout:.0f} s "
                                  "(is the engine started with coldsnap's plugin / COLDSNAP_CONTROL?)") from None
            time.sleep(0.1)


_SERVED_KEYS: dict[int, str] = {}


def use_served_key(port: int, key: str) -> None:
    """From now on this process's requests to the local ``port`` carry ``Authorization: Bearer key`` (a restore's
    --api-key-file: the canary and probes ask the server with the key it now requires)."""
    _SERVED_KEYS[port] = key


def _headers(port: int) -> dict[str, str]:
    key = _SERVED_KEYS.get(port)
    return {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}


def post_json(port: int, path: str, body: dict[str, Any], timeout: float = 120.0) -> Any:
    """POST ``body`` as JSON to ``path`` on the local server; its JSON answer ({} when empty). HTTP errors
    raise :class:`urllib.error.HTTPError` (an :class:`OSError`), as a server that does not answer does."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                     headers=_headers(port))
    with urllib.request.urlopen(request, timeout=timeout) as response:
        answer = response.read()
    return json.loads(answer) if answer else {}


def post_empty(port: int, path: str, timeout: float = 600.0) -> tuple[float, dict[str, Any]]:
    """POST nothing to ``path`` on the local server (vLLM's ``/sleep``, ``/wake_up``): (seconds, its JSON
    answer, or ``{"body": text}`` when the answer is not JSON)."""
    started = time.perf_counter()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=b"", method="POST", headers=_headers(port))
    with urllib.request.urlopen(req, timeout=timeout) as response:
        body = response.read()
    seconds = time.perf_counter() - started
    try:
        return seconds, json.loads(body) if body else {}
    except ValueError:
        return seconds, {"body": body.decode(errors="replace")}


def http_status(port: int, timeout: float = 5.0) -> int | None:
    """The HTTP status ``GET /health`` gets on the local ``port`` (an error status too); None when nothing
    answers HTTP there."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=timeout) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:  # an answer all the same (http.server's 404)
        return int(exc.code)
    except (OSError, http.client.HTTPException):  # URLError is an OSError; a reply that is not HTTP
        return None


def wait_for_http(port: int, alive: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if http_status(port) == 200:
            return
        if not alive():
            raise LaunchError("the serving process exited before it answered /health")
        if time.monotonic() > deadline:
            raise LaunchError(f"port {port} did not answer /health within {timeout:.0f} s")
        time.sleep(0.1)


class ServingTree(Protocol):
    """The serving process tree as a sequence drives it: started here (:class:`EngineProcess`) or restored."""

    control: str
    """Rank 0's agent socket."""

    @property
    def pid(self) -> int: ...

    def alive(self) -> bool: ...

    def kill(self) -> None: ...

    def log_tail(self, lines: int = 15) -> str: ...


class EngineProcess:
    """The captured command, started in its own session without io_uring, output to a log file. With
    ``agent=False`` the command as a user starts it (no ``COLDSNAP_CONTROL``, no launcher around it): the
    capture's plain reference start (:mod:`coldsnap.activation.reference_check`)."""

    def __init__(self, command: list[str], log_path: Path, environment: Mapping[str, str], agent: bool = True):
        """``environment``: the command's whole environment, secrets and coldsnap's own settings already left out
        (:func:`coldsnap.secrets.engine_env.engine_environment`)."""
        self.control = new_control_name() if agent else ""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        environment = {**environment, "PYTHONUNBUFFERED": "1"}
        argv = command
        if agent:
            environment[CONTROL_ENV] = self.control
            argv = [sys.executable, "-m", "coldsnap.snapshot.no_io_uring", "--", *command]
        else:
            environment.pop(CONTROL_ENV, None)
        # A file, not a pipe: a pipe to the launcher would be a connection CRIU cannot restore.
        log = open(log_path, "ab")
        try:
            self.process = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=environment,
                start_new_session=True,  # its own session and process group: no --shell-job, one killpg
            )
        except OSError as exc:
            raise LaunchError(f"cannot start {command[0]}: {exc.strerror or exc}") from None
        finally:
            log.close()

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def ended(self) -> str | None:
        """How the command ended, in words (``exited with status 3``, ``was killed by signal 9 (SIGKILL)``);
        None while it runs."""
        status = self.process.poll()
        if status is None:
            return None
        if status < 0:
            try:
                name = f" ({signal.Signals(-status).name})"
            except ValueError:
                name = ""
            return f"was killed by signal {-status}{name}"
        return f"exited with status {status}"

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def kill(self) -> None:
        kill_tree(self.pid)
        if self.process.poll() is None:
            self.process.wait(timeout=10)

    def stop(self, grace: float) -> None:
        """SIGTERM to the command's process group, as an operator stops a server (vLLM then shuts down and
        removes the files it made in its temporary folder); what still runs after ``grace`` s is killed."""
        try:
            os.killpg(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        self.kill()
