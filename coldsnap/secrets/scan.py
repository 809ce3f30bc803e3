"""The scan of an artifact's files for secrets: well-known token formats and the values of this
environment's secret-bearing variables, reported as file + offset + kind, never the value.

Hyperscan (through its Python bindings) is the prefilter: one compiled database of every format and value,
run over each file's bytes as memory-mapped chunks (64 MiB, each scanned with the 4 KiB before it, so a token
across a chunk's or a page's boundary is one match). Each candidate is then confirmed with Python's ``re`` on a
small window around it: the formats' boundaries (``hf_`` + 34 letters and no 35th) need look-arounds
Hyperscan lacks, and candidates are rare, so the confirmation costs nothing measurable.
"""

from __future__ import annotations

import mmap
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from coldsnap.secrets.names import names_a_secret

__all__ = ["TokenFormat", "TOKEN_FORMATS", "Finding", "ScanReport", "SecretScanner", "ScannerMissing",
           "secret_values", "MIN_VALUE_BYTES", "scan_artifact"]

CHUNK_BYTES = 64 << 20
OVERLAP_BYTES = 4096
"""Every match is at most this long (the longest format's window, a value's length when longer)."""
MIN_VALUE_BYTES = 8
"""A secret variable's value shorter than this is not searched for: it would match everywhere."""

_ALNUM = rb"A-Za-z0-9"


@dataclass(frozen=True)
class TokenFormat:
    """One well-known token format: ``body`` is both the Hyperscan prefilter and, between ``before`` and
    ``after`` (look-arounds), the exact Python pattern."""

    kind: str
    body: bytes
    before: bytes = b""
    after: bytes = b""
    longest: int = 256
    """The longest text ``body`` matches (the confirmation window)."""
    unless: bytes | None = None
    """A match holding this is a documented example, not a secret (``AKIAIOSFODNN7EXAMPLE``)."""
    mixed: bool = False
    """A match must mix upper case, lower case and digits, as generated keys do (``sk-`` is also how identifiers
    such as ``task-scheduler_...`` end)."""

    def exact(self) -> re.Pattern[bytes]:
        return re.compile(self.before + b"(?:" + self.body + b")" + self.after)


_NOT_ALNUM_BEFORE = rb"(?<![" + _ALNUM + rb"])"
_NOT_ALNUM_AFTER = rb"(?![" + _ALNUM + rb"])"
_NOT_TOKEN_BEFORE = rb"(?<![" + _ALNUM + rb"_\-])"

TOKEN_FORMATS: tuple[TokenFormat, ...] = (
    TokenFormat("huggingface", rb"hf_[A-Za-z]{34}", _NOT_ALNUM_BEFORE, _NOT_ALNUM_AFTER, 37),
    TokenFormat("huggingface-org", rb"api_org_[A-Za-z]{34}", _NOT_ALNUM_BEFORE, _NOT_ALNUM_AFTER, 42),
    TokenFormat("openai-style", rb"sk-(?:proj-|svcacct-|admin-|ant-)?[A-Za-z0-9_\-]{40}", _NOT_TOKEN_BEFORE, b"", 51,
                mixed=True),
    TokenFormat("github", rb"gh[pousr]_[A-Za-z0-9]{36}", _NOT_ALNUM_BEFORE, _NOT_ALNUM_AFTER, 40),
    TokenFormat("github-fine-grained", rb"github_pat_[A-Za-z0-9_]{82}", _NOT_ALNUM_BEFORE, b"", 93),
    TokenFormat("aws-access-key-id", rb"(?:AKIA|ASIA|ABIA|ACCA)[A-Z0-9]{16}", _NOT_ALNUM_BEFORE, _NOT_ALNUM_AFTER, 20,
                unless=b"EXAMPLE"),
    TokenFormat("slack", rb"xox[abposre]-[0-9]{4}[A-Za-z0-9\-]{6}", _NOT_ALNUM_BEFORE, b"", 15),
    TokenFormat("slack-webhook", rb"hooks\.slack\.com/services/T[A-Z0-9]{8}", b"", b"", 41),
    TokenFormat("jwt", rb"eyJ[A-Za-z0-9_\-]{10,1000}\.eyJ[A-Za-z0-9_\-]{10}", _NOT_TOKEN_BEFORE, b"", 1026),
    TokenFormat("pem-private-key",
                rb"-----BEGIN (?:RSA |EC |DSA |OPENSSH |ENCRYPTED |PGP )?PRIVATE KEY(?: BLOCK)?-----", b"", b"", 64),
)
"""The formats the scan knows, after the public specifications and the rules of secret scanners
(Hugging Face ``hf_`` tokens, OpenAI-style ``sk-`` keys, GitHub's ``gh?_`` and fine-grained tokens, AWS access
key ids, Slack tokens and webhooks, JSON Web Tokens, PEM private keys)."""


class ScannerMissing(RuntimeError):
    """The Hyperscan bindings (the ``hyperscan`` package) are not importable here."""


@dataclass(frozen=True)
class Finding:
    path: str
    """Relative to the scanned root."""
    offset: int
    """Of the secret's first byte in the file."""
    kind: str
    """A format of :data:`TOKEN_FORMATS`, or ``value of $NAME``."""

    def line(self) -> str:
        return f"{self.path}:{self.offset}: {self.kind}"

    def as_json(self) -> dict[str, Any]:
        return {"path": self.path, "offset": self.offset, "kind": self.kind}


@dataclass
class ScanReport:
    root: str
    files: int = 0
    bytes_scanned: int = 0
    seconds: float = 0.0
    findings: list[Finding] = field(default_factory=list)
    not_scanned: list[tuple[str, str]] = field(default_factory=list)
    """(path, why): files the scan leaves out on purpose (the native weight packs)."""
    values_searched: list[str] = field(default_factory=list)
    """The names whose values the scan looked for (never the values)."""

    @property
    def clean(self) -> bool:
        return not self.findings

    @property
    def bytes_per_second(self) -> float:
        return self.bytes_scanned / self.seconds if self.seconds > 0 else 0.0

    def as_json(self) -> dict[str, Any]:
        return {"root": self.root, "clean": self.clean, "files": self.files, "bytes_scanned": self.bytes_scanned,
                "seconds": round(self.seconds, 4), "findings": [f.as_json() for f in self.findings],
                "not_scanned": [{"path": p, "why": why} for p, why in self.not_scanned],
                "values_searched": self.values_searched}


def secret_values(environment: Mapping[str, str] | None = None) -> dict[str, str]:
    """The values to search for: those of ``environment``'s (default: this process's) variables whose names say
    they are secret (a word such as TOKEN or KEY, or a name of :data:`SECRET_NAMES`), at least
    :data:`MIN_VALUE_BYTES` long, and not a file path (the file's contents are the secret, not its name)."""
    environment = os.environ if environment is None else environment
    return {name: value for name, value in sorted(environment.items())
            if names_a_secret(name) and len(value.encode()) >= MIN_VALUE_BYTES and not os.path.isabs(value)}


def _literal(value: bytes) -> bytes:
    return b"".join(b"\\x%02x" % byte for byte in value)


class SecretScanner:
    """One compiled Hyperscan database of :data:`TOKEN_FORMATS` and the given values; thread-safe (each scan
    takes its own scratch space)."""

    def __init__(self, values: Mapping[str, str] | None = None):
        try:
            import hyperscan
        except ImportError as exc:
            raise ScannerMissing(f"the secret scan needs the hyperscan package ({exc}): pip install hyperscan") from None
        self._hyperscan = hyperscan
        self.values = {name: value.encode() for name, value in (values or {}).items()}
        self._formats = list(TOKEN_FORMATS)
        self._exact = [f.exact() for f in self._formats]
        self._value_kinds = [(f"value of ${name}", value) for name, value in self.values.items()]
        expressions = [f.body for f in self._formats] + [_literal(value) for _, value in self._value_kinds]
        self.longest = max([OVERLAP_BYTES] + [len(v) for v in self.values.values()])
        self._database = hyperscan.Database(mode=hyperscan.HS_MODE_BLOCK)
        self._database.compile(expressions=expressions, ids=list(range(len(expressions))), elements=len(expressions),
                               flags=[0] * len(expressions))
        self._scratch = hyperscan.Scratch(self._database)

    def scan_bytes(self, data: bytes | bytearray | memoryview | mmap.mmap, path: str = "") -> list[Finding]:
        """Every secret in ``data``, in offset order."""
        view = memoryview(data) if not isinstance(data, memoryview) else data
        size = len(view)
        found: set[tuple[int, str]] = set()
        scratch = self._scratch.clone()
        candidates: list[tuple[int, int]] = []

        def on_match(expression: int, _start: int, end: int, _flags: int, base: object) -> None:
            candidates.append((expression, int(base) + end))  # type: ignore[call-overload]

        for start in range(0, max(size, 1), CHUNK_BYTES):
            first = max(0, start - self.longest)
            stop = min(size, start + CHUNK_BYTES)
            before = len(candidates)
            with view[first:stop] as chunk:  # released at once: the file's mapping closes after the scan
                buffer: Any = chunk  # (Hyperscan's stubs say str or bytes; it takes any buffer)
                self._database.scan(buffer, match_event_handler=on_match, context=first, scratch=scratch)
                del buffer
            # an end inside the part scanned again belongs to the previous chunk, which confirmed it
            candidates[before:] = [c for c in candidates[before:] if c[1] > start or start == 0]
        for expression, end in candidates:
            confirmed = self._confirm(view, expression, end)
            if confirmed is not None:
                found.add(confirmed)
        return [Finding(path, offset, kind) for offset, kind in sorted(found)]

    def _confirm(self, view: memoryview, expression: int, end: int) -> tuple[int, str] | None:
        if expression >= len(self._formats):
            kind, value = self._value_kinds[expression - len(self._formats)]
            return end - len(value), kind
        token = self._formats[expression]
        first = max(0, end - token.longest - 1)
        window = bytes(view[first:end + 1])
        target = end - first
        exact = self._exact[expression]
        match = exact.search(window)
        while match is not None and match.end() < target:
            match = exact.search(window, match.start() + 1)
        if match is None or match.end() != target:
            return None
        text = match.group(0)
        if token.unless is not None and token.unless in text:
            return None
        if token.mixed and not all(re.search(kind, text[3:]) for kind in (rb"[A-Z]", rb"[a-z]", rb"[0-9]")):
            return None
        return first + match.start(), token.kind

    def scan_file(self, path: Path, relative: str) -> tuple[int, list[Finding]]:
        """(bytes scanned, findings) of one file."""
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            if size == 0:
                return 0, []
            with mmap.mmap(file.fileno(), 0, prot=mmap.PROT_READ) as mapped:
                if hasattr(mmap, "MADV_SEQUENTIAL"):
                    mapped.madvise(mmap.MADV_SEQUENTIAL)
                view = memoryview(mapped)
                try:
                    return size, self.scan_bytes(view, relative)
                finally:
                    view.release()


def scan_artifact(root: Path, scanner: SecretScanner | None = None, include_packs: bool = False,
                  threads: int | None = None, files: Iterable[Path] | None = None) -> ScanReport:
    """Scan every regular file under ``root`` (page images, every other CRIU image, the descriptor, request,
    logs, residuals); the native weight packs only with ``include_packs``. Files are scanned on ``threads``
    threads at once (default: the CPUs this process may use, at most 8); Hyperscan releases the GIL."""
    scanner = scanner if scanner is not None else SecretScanner(secret_values())
    report = ScanReport(str(root), values_searched=sorted(scanner.values))
    chosen = []
    for path in sorted(files if files is not None else (p for p in root.rglob("*") if p.is_file() and not p.is_symlink())):
        relative = str(path.relative_to(root))
        # the native weight packs: the model's parameters as the GPU held them (GBs, nothing of the process's memory)
        if path.suffix == ".pack" and not include_packs:
            report.not_scanned.append((relative, "native weight pack (model parameters; --include-packs scans it)"))
        else:
            chosen.append((path, relative))
    workers = threads or min(8, len(os.sched_getaffinity(0)))
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for size, findings in pool.map(lambda item: scanner.scan_file(*item), chosen):
            report.files += 1
            report.bytes_scanned += size
            report.findings.extend(findings)
    report.seconds = time.perf_counter() - started
    return report
