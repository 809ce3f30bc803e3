"""``coldsnap doctor``: what this host can do for capture and restore.

It probes, it does not admit: restore admission repeats the checks that matter for one artifact.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from coldsnap import __version__
from coldsnap.contracts.profiles import SNAPSHOT_DRIVERS
from coldsnap.host import host_facts, nvidia_kernel_driver
from coldsnap.native import probe_cuda
from coldsnap.snapshot.criu_binary import (MINIMUM_VERSION, THP_FILL_ENV, Criu, CriuError, fill_threads_wanted,
                                           thp_fill_wanted)
from coldsnap.settings import SETTINGS

__all__ = ["collect_report", "render_table"]


def _criu_section() -> dict[str, Any]:
    section: dict[str, Any] = {"path": None, "version": None, "version_ok": False, "fills_huge_pages": False,
                               "fill_used_here": False, "fill_threads": 0, "keeps_kernel_facts": False, "check_ok": False,
                               "detail": ""}
    try:
        criu = Criu()
        section["path"] = criu.path
        version = criu.version()
        section["version"] = ".".join(str(p) for p in version.numbers)
        section["version_ok"] = version.numbers[:2] >= MINIMUM_VERSION
        section["fills_huge_pages"] = version.fills_huge_pages
        section["fill_used_here"] = version.fills_huge_pages and thp_fill_wanted()
        # helper threads per restored process that this host's restores allow CRIU for its fill
        section["fill_threads"] = fill_threads_wanted() if version.fills_in_parallel else 0
        section["keeps_kernel_facts"] = version.keeps_kernel_facts
        if os.geteuid() != 0:
            section["detail"] = "criu check needs root; run doctor as root"
            return section
        check = criu.check()
        section["check_ok"] = check.ok
        section["detail"] = "Looks good." if check.ok else check.output
    except CriuError as exc:
        section["detail"] = str(exc) if exc.op != "locate" else exc.log_tail
    if section["path"] and not section["version_ok"] and section["version"]:
        minimum = ".".join(map(str, MINIMUM_VERSION))
        section["detail"] = f"CRIU {section['version']} is too old (need >= {minimum}); " + section["detail"]
    return section


def collect_report() -> dict[str, Any]:
    """Everything doctor knows, as JSON values."""
    driver = nvidia_kernel_driver()
    driver_major = int(driver.split(".")[0]) if driver else None
    cuda = probe_cuda()
    criu = _criu_section()
    drivers = {}
    for name, profile in SNAPSHOT_DRIVERS.items():
        problems = []
        if driver_major is None:
            problems.append("no NVIDIA driver")
        elif driver_major < profile.minimum_nvidia_driver:
            problems.append(f"NVIDIA driver {driver} < {profile.minimum_nvidia_driver}")
        if profile.cuda_checkpoint and not cuda.get("checkpoint_api"):
            problems.append("no CUDA checkpoint API")
        if not (criu["version_ok"] and criu["check_ok"]):
            problems.append("CRIU not usable")
        drivers[name] = {"usable": not problems, "problems": problems}
    return {
        "coldsnap": __version__,
        "python": sys.version.split()[0],
        "host": host_facts(),
        "criu": criu,
        "nvidia_driver": driver,
        "cuda": cuda,
        "snapshot_drivers": drivers,
    }


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def render_table(report: dict[str, Any]) -> str:
    """The report for a person."""
    rows: list[tuple[str, str, str]] = []

    def row(name: str, ok: bool | None, value: str) -> None:
        rows.append((name, {True: "ok", False: "NO", None: "--"}[ok], value))

    host = report["host"]
    row("coldsnap", True, f"{report['coldsnap']} (python {report['python']})")
    row("host", True, f"{host['arch']}, kernel {host['kernel']}, {'root' if host['root'] else 'not root'}")
    criu = report["criu"]
    if criu["path"]:
        fill = ("stock build: no huge-page fill" if not criu["fills_huge_pages"] else "fills huge pages" if
                criu.get("fill_used_here") else "fills huge pages; turned off by COLDSNAP_CRIU_THP_FILL=0" if
                SETTINGS.choice(THP_FILL_ENV) == "0" else "fills huge pages; not used here: this VM's balloon "
                "reports free pages (COLDSNAP_CRIU_THP_FILL=1 forces it)")
        if criu["fills_huge_pages"]:
            fill += (f"; fills on {criu['fill_threads'] + 1} threads per process" if criu.get("fill_threads") else
                     "; fills on one thread per process")
        if criu.get("keeps_kernel_facts"):
            fill += "; keeps its kernel probes per boot"
        row("criu", criu["version_ok"], f"{criu['version']} at {criu['path']} ({fill})")
        row("criu check", criu["check_ok"], criu["detail"].splitlines()[-1] if criu["detail"] else "")
    else:
        row("criu", False, criu["detail"])
    row("nvidia driver", report["nvidia_driver"] is not None, report["nvidia_driver"] or "not loaded (no /proc/driver/nvidia)")
    cuda = report["cuda"]
    if cuda.get("available"):
        api = cuda["driver_version"]
        row("cuda driver api", True, f"{api // 1000}.{api % 1000 // 10} ({cuda['library']})")
        row("checkpoint api", cuda["checkpoint_api"], "cuCheckpointProcess* present" if cuda["checkpoint_api"] else "missing")
        row("vmm api", cuda["vmm_api"], "cuMemAddressReserve/cuMemCreate/cuMemMap present" if cuda["vmm_api"] else "missing")
        for dev in cuda["devices"]:
            row(
                f"gpu {dev['ordinal']}",
                True,
                f"{dev['name']}, cc {dev['compute_capability']}, {_gib(dev['total_memory_bytes'])}, {dev['uuid']}, pci {dev['pci_bus_id']}",
            )
    else:
        row("cuda", False, cuda.get("reason", "unavailable"))
        row("gpus", None, "none present")
    for name, verdict in report["snapshot_drivers"].items():
        row(f"driver {name}", verdict["usable"], "usable" if verdict["usable"] else "; ".join(verdict["problems"]))
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{name:<{width}}  {mark:<2}  {value}" for name, mark, value in rows)
