"""The launcher's side of the control protocol (:mod:`coldsnap.agent.protocol`): typed calls to one
rank's agent, and the lease that ties a restored tree to its launcher until the canary matched."""

from __future__ import annotations

import json
import socket
from typing import Any, Callable, Sequence, TypeVar

from coldsnap.agent.addresses import address
from coldsnap.agent.protocol import (
    MAX_FDS_PER_MESSAGE,
    AgentFailure,
    LeaseTaken,
    Message,
    Prepare,
    PrepareReply,
    ProgressLine,
    ProtocolError,
    Resume,
    ResumeReply,
    Standby,
    StandbyReply,
    Status,
    StatusReply,
    TakeLease,
    decode_reply,
    encode,
    receive_line,
)

__all__ = ["AgentClient", "AgentError", "KeyGateError", "KeyGateMissing", "Lease", "TemplateClient", "TemplateLink",
           "TemplateRefused", "install_api_key", "key_gate"]

R = TypeVar("R", StatusReply, PrepareReply, ResumeReply, StandbyReply)
OnProgress = Callable[[str, int, int], None]


class AgentError(RuntimeError):
    """The agent refused or failed a command (``failure`` says how), or could not be talked to
    (``failure`` is None: connection refused, closed, or a reply of another protocol)."""

    def __init__(self, message: str, failure: AgentFailure | None = None):
        super().__init__(message)
        self.failure = failure

    @property
    def code(self) -> str | None:
        return self.failure.code if self.failure is not None else None


class AgentClient:
    """One rank's agent at ``control``; each call is one connection."""

    def __init__(self, control: str, timeout: float = 600):
        self.control = control
        self.timeout = timeout

    def status(self) -> StatusReply:
        return self._call(Status(), StatusReply)

    def prepare(self, command: Prepare, on_progress: OnProgress | None = None) -> PrepareReply:
        return self._call(command, PrepareReply, on_progress)

    def resume(self, command: Resume, on_progress: OnProgress | None = None, fds: list[int] | None = None) -> ResumeReply:
        """``fds`` travel with the command (SCM_RIGHTS); the caller still owns and closes its copies."""
        return self._call(command, ResumeReply, on_progress, fds or [])

    def standby(self, command: Standby) -> StandbyReply:
        return self._call(command, StandbyReply)

    def _call(self, command: Message, expected: type[R], on_progress: OnProgress | None = None,
              fds: Sequence[int] = ()) -> R:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.settimeout(self.timeout)
            connection.connect(address(self.control))
            line = encode(command)
            batches = [list(fds[i:i + MAX_FDS_PER_MESSAGE]) for i in range(0, len(fds), MAX_FDS_PER_MESSAGE)]
            for batch in batches[:-1]:
                socket.send_fds(connection, [b" "], batch)  # JSON allows leading blanks
            if batches:
                socket.send_fds(connection, [line], batches[-1])
            else:
                connection.sendall(line)
            reader = connection.makefile("rb")
            while True:
                line = reader.readline()
                if not line or not line.startswith(b'{"progress"'):
                    break
                if on_progress is not None:
                    update = ProgressLine.model_validate_json(line).progress
                    on_progress(update.phase, update.done, update.total)
        if not line:
            raise AgentError(f"agent at {self.control} closed the connection without answering")
        try:
            reply = decode_reply(line, expected)
        except ProtocolError as exc:
            raise AgentError(f"agent at {self.control}: {exc}") from None
        if reply.failure is not None:
            raise AgentError(f"{reply.failure.type}: {reply.failure.message}", reply.failure)
        return reply.reply  # type: ignore[return-value]  # decode_reply checked it is an `expected`


class Lease:
    """The launcher's side of :func:`coldsnap.agent.server.hold_lease`: taken on each rank's agent right
    after CRIU restored the tree, released once the canary matched. If the launcher dies in between,
    the kernel closes these connections and each agent stops its process tree."""

    def __init__(self, controls: list[str], timeout: float = 30.0):
        self._connections: list[socket.socket] = []
        try:
            for control in controls:
                connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self._connections.append(connection)
                connection.settimeout(timeout)
                connection.connect(address(control))
                connection.sendall(encode(TakeLease()))
                answer = connection.makefile("rb").readline()
                try:
                    LeaseTaken.model_validate_json(answer)
                except ValueError:
                    raise AgentError(f"agent at {control} did not take the lease: {answer[:200]!r}") from None
        except BaseException:
            self.close()
            raise

    def release(self) -> None:
        """The server is on its own from now on."""
        for connection in self._connections:
            try:
                connection.sendall(b"release\n")
            except OSError:
                pass
        self.close()

    def close(self) -> None:
        for connection in self._connections:
            connection.close()
        self._connections = []


class TemplateClient:
    """The launcher's side of an n580 template (:mod:`coldsnap.agent.template`): one JSON line per
    connection. OSError when none answers at ``control``; ValueError for an answer that is not a template's."""

    def __init__(self, control: str, timeout: float = 30.0):
        self.control, self.timeout = control, timeout

    def _ask(self, request: dict[str, Any]) -> tuple[dict[str, Any], socket.socket]:
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            client.settimeout(self.timeout)
            client.connect(address(self.control))
            client.sendall(json.dumps(request).encode() + b"\n")
            line, _ = receive_line(client)  # a template sends no descriptors
            answer = json.loads(line or b"null")
            if not isinstance(answer, dict):
                raise ValueError(f"the template at {self.control} answered {answer!r}")
        except BaseException:
            client.close()
            raise
        return answer, client

    def status(self) -> dict[str, Any]:
        """``{"state": "boundary", "abi": ..., "pid": ..., "preloaded": [...]}``."""
        answer, connection = self._ask({"op": "status"})
        connection.close()
        return answer

    def place(self, placement: dict[str, Any]) -> "TemplateLink":
        """Hand it its placement (a :class:`coldsnap.contracts.placement.PlacementRecord`'s JSON value);
        :class:`TemplateRefused` when it refuses (it then keeps waiting). The placed engine lives only as
        long as the returned link, until :meth:`TemplateLink.handover`."""
        answer, connection = self._ask({"op": "place", "placement": placement})
        if answer.get("ok") is not True:
            connection.close()
            raise TemplateRefused(f"the template refused the placement: {answer.get('error', answer)}")
        return TemplateLink(connection)


class TemplateLink:
    """The placing connection to a template: closed before :meth:`handover`, the template stops its
    process group (so a launcher that dies leaves no engine behind)."""

    def __init__(self, connection: socket.socket):
        self._connection: socket.socket | None = connection

    def handover(self) -> None:
        """The engine is held otherwise now (its agent's lease): the template stops watching this launcher."""
        if self._connection is not None:
            self._connection.sendall(b"handover\n")
            self.close()

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None


class TemplateRefused(ValueError):
    """A template refused its placement (another placement ABI, a malformed record)."""


class KeyGateError(RuntimeError):
    """The served HTTP process's key gate did not take the message (it refused, or answered no JSON)."""


class KeyGateMissing(KeyGateError):
    """No key gate listens for this control: an engine without one (the reference workload), or a capture by a
    build before it."""


def key_gate(control: str, message: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
    """Send ``message`` (``{"api_key": KEY}``, ``{"hold": true}``, ``{"open": true}``) to the key gate of every
    HTTP process of rank 0's engine (:mod:`coldsnap.agent.api_key`), named after ``control``: ``gates``, the apps
    they guard in all; ``processes``, how many answered. :class:`KeyGateMissing` when none listens."""
    from coldsnap.agent.addresses import MOST_GATES, key_gate_control

    gates = processes = 0
    for index in range(MOST_GATES):
        name = key_gate_control(control, index)
        try:
            reply = _key_gate_call(name, message, timeout)
        except KeyGateMissing:
            if index == 0:
                raise
            break
        gates += int(reply.get("gates") or 0)
        processes += 1
    return {"ok": True, "gates": gates, "processes": processes}


def _key_gate_call(name: str, message: dict[str, Any], timeout: float) -> dict[str, Any]:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.settimeout(timeout)
            try:
                connection.connect(address(name))
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                raise KeyGateMissing(f"no key gate answered at {name} ({exc.strerror or exc}): the server's HTTP "
                                     "process runs without coldsnap's engine plugin, or was captured by a build "
                                     "without the gate") from None
            connection.sendall(json.dumps(message).encode() + b"\n")
            data, _ = receive_line(connection)
        reply = json.loads(data)
    except OSError as exc:
        raise KeyGateError(f"the key gate at {name} did not answer: {exc.strerror or exc}") from None
    except ValueError:
        raise KeyGateError(f"the key gate at {name} answered something that is not JSON") from None
    if not reply.get("ok"):
        raise KeyGateError(f"the key gate at {name} refused: {reply.get('error')}")
    return dict(reply)


def install_api_key(control: str, key: str, timeout: float = 10.0) -> dict[str, Any]:
    """The served API key into every key gate (:func:`key_gate`); :class:`KeyGateError` unless an app now requires it."""
    reply = key_gate(control, {"api_key": key}, timeout)
    if not reply.get("gates"):
        raise KeyGateError(f"the key gate at {control} guards no HTTP app yet (the server has not built one)")
    return reply
