"""One ``coldsnap restore DIR --unit-hosts H0,H1,...`` drives every unit of an artifact of several launch units on
its own host, through the manager's host provider (:mod:`coldsnap.provider.client`). (Capture, warm and wake take
the same way later: :func:`drive_units` is written for any of them; only restore's CLI offers it yet.)

Each host holds its unit's capsule at the same ``DIR`` (as a capture of several units leaves it). The driver:

1. reads the artifact's descriptor from unit 0's host (``get``): how many units, which is which;
2. asks each host its address (``probe``: ``hostname -I``, the first one), unit 0's becomes the rendezvous;
3. writes a fresh activation token to each host (``put``, mode 0600);
4. starts ``coldsnap OPERATION DIR --units N --unit K --rendezvous ADDR0:PORT --address ADDRK ...`` on every host
   at once (``exec``; unit 0 also serves the coordinator), each writing its receipt on its stdout;
5. waits for all: the first unit that fails (its exit status, or the provider's failure) has every other unit's
   command cancelled at once — their process groups killed on their hosts — and the operation fails naming it.

Unit 0's receipt carries every unit's spans (one clock per unit): it is this command's receipt. The token files are
removed from the hosts afterwards. The hosts must run coldsnap at the same path as this process
(``sys.executable -m coldsnap``): a serving image does.
"""

from __future__ import annotations

import json
import secrets
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from coldsnap.provider.client import ExecResult, HostProvider, ProviderError, RunningExec

__all__ = ["UnitFailed", "UnitsOutcome", "drive_units"]

RENDEZVOUS_PORT = 29600
T = TypeVar("T")


class UnitFailed(Exception):
    """A unit's host failed the operation (``unit``, ``host``: which; the message says how)."""

    def __init__(self, unit: int, host: str, message: str, receipt: dict[str, Any] | None = None):
        super().__init__(f"unit {unit} on host {host}: {message}")
        self.unit, self.host, self.receipt = unit, host, receipt


@dataclass(frozen=True)
class UnitsOutcome:
    receipts: list[dict[str, Any] | None]
    """Each unit's receipt, in unit order (unit 0's carries every unit's spans)."""
    seconds: float


def _address(provider: HostProvider, unit: int, host: str) -> str:
    answer = provider.probe(host, ["hostname", "-I"])
    words = answer.stdout.decode().split()
    if answer.status != 0 or not words:
        raise UnitFailed(unit, host, f"no address (hostname -I: {answer.stderr.decode().strip() or 'nothing'})")
    return words[0]


def _on_every_host(hosts: list[str], call: Callable[[str, int], T]) -> list[T]:
    """``call(host, unit)`` for every unit's host at once, the answers in unit order (the first exception raised)."""
    with ThreadPoolExecutor(max_workers=len(hosts), thread_name_prefix="coldsnap-units") as pool:
        return list(pool.map(call, hosts, range(len(hosts))))


def _removed(provider: HostProvider, host: str, path: str) -> None:
    try:
        provider.exec(host, ["rm", "-f", path], timeout_s=10)
    except ProviderError:
        pass


def _receipt_of(result: ExecResult) -> dict[str, Any] | None:
    try:
        document = json.loads(result.stdout)
    except ValueError:
        return None
    return document if isinstance(document, dict) else None


def drive_units(provider: HostProvider, operation: str, directory: str, hosts: list[str], extra: list[str],
                progress: Any = None, rendezvous_port: int = RENDEZVOUS_PORT) -> UnitsOutcome:
    """``operation`` of the artifact at ``directory`` on ``hosts`` (unit K on ``hosts[K]``); ``extra``: flags every
    unit's command gets (``--port``, ``--weights`` ...). :class:`UnitFailed` naming the first unit that failed,
    every other unit's command cancelled."""
    say = progress or (lambda line: print(f"coldsnap {operation}: {line}", file=sys.stderr))
    started = time.monotonic()
    try:
        descriptor = json.loads(provider.get(hosts[0], f"{directory}/artifact.json"))
    except (ProviderError, ValueError) as exc:
        raise UnitFailed(0, hosts[0], f"cannot read {directory}/artifact.json there: {exc}") from None
    units = len(descriptor.get("units") or [])
    if units < 2 or units != len(hosts):
        raise UnitFailed(0, hosts[0], f"{directory} is an artifact of {units} launch unit(s); --unit-hosts names "
                         f"{len(hosts)} host(s): name one host per unit, unit 0's first")
    # (each host's round trips at once: the provider serves requests side by side)
    addresses = _on_every_host(hosts, lambda host, k: _address(provider, k, host))
    token_file = f"/tmp/coldsnap-rendezvous-{secrets.token_hex(8)}.token"
    token = secrets.token_hex(32).encode()
    _on_every_host(hosts, lambda host, _: provider.put(host, token_file, token, mode=0o600))
    say(f"{units} units on {', '.join(f'{h} ({a})' for h, a in zip(hosts, addresses))}; the coordinator on "
        f"{hosts[0]}")
    running: list[RunningExec] = []
    try:
        for k, host in enumerate(hosts):
            argv = [sys.executable, "-m", "coldsnap", operation, directory, "--units", str(units), "--unit", str(k),
                    "--rendezvous", f"{addresses[0]}:{rendezvous_port}", "--rendezvous-token-file", token_file,
                    "--address", addresses[k], "--receipt-json", "-", *extra]
            if k == 0:
                argv += ["--serve-rendezvous", f"0.0.0.0:{rendezvous_port}"]
            running.append(provider.start_exec(host, argv))
        results = _every_unit(running, hosts)
    finally:  # (the token's copies go, whatever happened)
        _on_every_host(hosts, lambda host, _: _removed(provider, host, token_file))
    return UnitsOutcome([_receipt_of(result) for result in results], time.monotonic() - started)


def _every_unit(running: list[RunningExec], hosts: list[str]) -> list[ExecResult]:
    """Every unit's result; the first failure cancels every other unit's command and is raised, named."""
    results: list[ExecResult | None] = [None] * len(running)
    failures: list[UnitFailed] = []
    done = threading.Condition()

    def wait(k: int) -> None:
        try:
            result = running[k].wait()
            failure = None if result.status == 0 else UnitFailed(
                k, hosts[k], f"exit status {result.status if result.status is not None else f'signal {result.signal}'}"
                + (f": {result.stderr.decode(errors='replace').strip().splitlines()[-1]}" if result.stderr.strip() else ""),
                _receipt_of(result))
        except ProviderError as exc:
            result, failure = None, UnitFailed(k, hosts[k], str(exc))
        with done:
            results[k] = result
            if failure is not None:
                failures.append(failure)
            done.notify_all()

    for k in range(len(running)):
        threading.Thread(target=wait, args=(k,), name=f"coldsnap-unit-{k}", daemon=True).start()
    with done:
        while not failures and any(r is None for r in results):
            done.wait()
        if failures:
            for k, each in enumerate(running):
                if results[k] is None:
                    each.cancel()
            raise failures[0]
    return [r for r in results if r is not None]
