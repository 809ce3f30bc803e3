"""Which of the GPU bundle's wheels go onto the GPU test host: none that would shadow a distribution the host
already has at an equal or newer version.

scripts/gpu-test.sh installs the bundle's wheels into a folder that goes first on PYTHONPATH, so a package
there wins over the host's own: once the bundle's typing_extensions 4.15 (this checkout's .venv pin then)
shadowed the host's newer one and every vLLM start failed.

    python3 scripts/gpu-bundle-wheels.py prune [--host-packages FILE] DIR...
        on the connected machine (gpu-prepare.sh): delete from each DIR the wheels whose distribution the
        documented host (FILE, default scripts/h200-host-packages.txt) has at an equal or newer version. One
        listed there without a version is kept: the host decides.
    python3 scripts/gpu-bundle-wheels.py select WHEEL...
        on the host (gpu-test.sh, with the host's own PYTHONPATH): print the wheels whose distribution this
        python lacks or has at an older version, one a line; the others are named on stderr.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import sys
from pathlib import Path

from packaging.version import InvalidVersion, Version

HOST_PACKAGES = Path(__file__).resolve().with_name("h200-host-packages.txt")


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_release(wheel: Path) -> tuple[str, Version]:
    """(normalized distribution, version) from a wheel's file name (``name-version-...whl``)."""
    name, version = wheel.name.split("-")[:2]
    return normalize(name), Version(version)


def read_host_packages(path: Path = HOST_PACKAGES) -> dict[str, Version | None]:
    """The documented host's distributions: normalized name → version (None: there, version not documented)."""
    packages: dict[str, Version | None] = {}
    for line in path.read_text().splitlines():
        fields = line.split("#", 1)[0].split()
        if fields:
            packages[normalize(fields[0])] = Version(fields[1]) if len(fields) > 1 else None
    return packages


def installed_packages() -> dict[str, Version | None]:
    """What this python imports: normalized name → version (the first found on sys.path, as import would)."""
    packages: dict[str, Version | None] = {}
    for distribution in importlib.metadata.distributions():
        name = normalize(distribution.metadata["Name"] or "")
        if name and name not in packages:
            try:
                packages[name] = Version(distribution.version)
            except InvalidVersion:
                packages[name] = None
    return packages


def would_shadow(wheel: Path, host: dict[str, Version | None]) -> str | None:
    """Why ``wheel`` must not be carried (the host has its distribution at an equal or newer version), else None."""
    name, version = wheel_release(wheel)
    if name not in host or host[name] is None:
        return None  # the host lacks it, or its version is not known here: carried, the host checks again
    if host[name] >= version:  # type: ignore[operator]
        return f"{wheel.name}: the host has {name} {host[name]}"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = parser.add_subparsers(dest="action", required=True)
    prune = actions.add_parser("prune")
    prune.add_argument("--host-packages", type=Path, default=HOST_PACKAGES)
    prune.add_argument("dirs", nargs="+", type=Path)
    select = actions.add_parser("select")
    select.add_argument("wheels", nargs="*", type=Path)
    args = parser.parse_args()
    if args.action == "prune":
        host = read_host_packages(args.host_packages)
        for wheel in sorted(w for d in args.dirs for w in d.glob("*.whl")):
            reason = would_shadow(wheel, host)
            if reason is not None:
                print(f"gpu-prepare: not carried, {reason} ({args.host_packages.name})", file=sys.stderr)
                wheel.unlink()
        return 0
    installed = installed_packages()
    for wheel in args.wheels:
        reason = would_shadow(wheel, installed)
        if reason is None:
            print(wheel)
        else:
            print(f"gpu-test: not installed, {reason}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
