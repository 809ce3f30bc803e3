"""What stands between an artifact and a registry: the secrets its descriptor says it holds (passed on
deliberately at capture) and what the scan finds in its files. ``coldsnap publish`` and
``coldsnap validate secrets`` both ask :func:`secrets_of_artifact`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from coldsnap.contracts.artifact import ArtifactDescriptor
from coldsnap.contracts.base import decode_document
from coldsnap.secrets.scan import ScanReport, SecretScanner, scan_artifact, secret_values

__all__ = ["ArtifactSecrets", "secrets_of_artifact"]


@dataclass(frozen=True)
class ArtifactSecrets:
    held: dict[str, list[str]]
    """Unit id → the secret-bearing names its command was given deliberately (the descriptor's record)."""
    unrecorded: list[str]
    """Units captured by a build that passed the whole environment on (no record): anything may be in them."""
    report: ScanReport

    @property
    def clean(self) -> bool:
        return self.report.clean and not any(self.held.values())

    def lines(self) -> list[str]:
        """One line per problem, never a value."""
        lines = [f"{unit}: the capsule holds {', '.join(names)} (passed to the command with --env or the request's "
                 "env at capture)" for unit, names in self.held.items() if names]
        lines += [finding.line() for finding in self.report.findings]
        return lines

    def summary(self) -> str:
        report = self.report
        rate = f", {report.bytes_per_second / 1e9:.2f} GB/s" if report.seconds > 0.01 else ""
        found = "clean" if report.clean else f"{len(report.findings)} finding(s)"
        skipped = f"; {len(report.not_scanned)} native pack(s) not scanned" if report.not_scanned else ""
        return (f"scanned {report.files} files, {report.bytes_scanned / 2**20:.1f} MiB in {report.seconds:.2f} s{rate}: "
                f"{found}{skipped}")


def secrets_of_artifact(root: Path, include_packs: bool = False, scanner: SecretScanner | None = None) -> ArtifactSecrets:
    """The descriptor's record of held names, and the scan of every file (ValueError/ContractError: no
    readable descriptor; :class:`~coldsnap.secrets.scan.ScannerMissing`: no Hyperscan here)."""
    descriptor = decode_document(ArtifactDescriptor, (root / "artifact.json").read_bytes(), str(root / "artifact.json"))
    held = {unit.unit_id: list(unit.environment.held) for unit in descriptor.units if unit.environment is not None}
    unrecorded = [unit.unit_id for unit in descriptor.units if unit.environment is None]
    report = scan_artifact(root, scanner or SecretScanner(secret_values()), include_packs=include_packs)
    return ArtifactSecrets(held, unrecorded, report)
