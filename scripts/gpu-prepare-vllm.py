"""vLLM 0.26 for the offline GPU test host, as parts a device call can carry (`gpu-prepare.sh --vllm`).

    python3 scripts/gpu-prepare-vllm.py BUNDLE_DIR [--part-mib 62] [--version 0.26.0]

The host has Python 3.12 with torch 2.11.0+cu130 and much of vLLM's stack (KINDS.md, "Python packages
already there"); vLLM 0.26.0 pins exactly that torch. This resolves vLLM's dependencies for the host
(Python 3.12, manylinux x86_64, wheels only, one `pip install --dry-run --report`), keeps vLLM and the
packages the host lacks (``HOST_LACKS``, what REFERENCE.md found a `vllm serve` of a dense model to
need), downloads them, installs them into a staging tree (no compilation: `--target` with the host's
tags), drops the native libraries a dense bf16 model on Hopper never loads (``DROPPED``: FA2, MoE,
FlashMLA, QuTLASS, DeepGEMM — FA3 and ``_C`` stay), and writes the tree as one tar.gz split into
parts of at most ``--part-mib`` MiB: ``BUNDLE_DIR/vllm/vllm-site.tar.gz.partNN`` plus
``vllm-site.json`` (versions, sizes, SHA-256 of the whole). ``scripts/gpu-vllm.sh`` puts it together on
the host. Downloads are cached in ``BUNDLE_DIR/vllm-cache``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

HOST_TAGS = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:",
             *[a for p in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64",
                           "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
                           "manylinux1_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "linux_x86_64",
                           "any") for a in ("--platform", p)]]

# What the host lacks of vLLM 0.26's stack (REFERENCE.md, "vLLM on the H200 test host"). Normalized names.
HOST_LACKS = """
agent-detector annotated-types anthropic apache-tvm-ffi astor blake3 cachetools cbor2 cffi compressed-tensors
cryptography cuda-python depyf detect-installer dill dnspython docstring-parser email-validator fastapi fastapi-cli
fastapi-cloud-cli fastar fastsafetensors flashinfer-python googleapis-common-protos httpcore2 httptools httpx2
humming-kernels ijson interegular jiter jmespath jsonschema jsonschema-specifications lark llguidance
lm-format-enforcer loguru mcp mcp-types mistral-common model-hosting-container-standards msgspec nvidia-cuda-crt
nvidia-cudnn-frontend nvtx openai openai-harmony opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp
opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-otlp-proto-grpc opentelemetry-exporter-otlp-proto-http
opentelemetry-proto opentelemetry-semantic-conventions opentelemetry-semantic-conventions-ai outlines-core
partial-json-parser prometheus-fastapi-instrumentator pybase64 pycountry pycparser pydantic pydantic-core
pydantic-extra-types pydantic-settings pyelftools pyjwt python-dotenv python-json-logger python-multipart pyzmq
quack-kernels referencing rich-toolkit rignore rpds-py sentry-sdk setproctitle sniffio sse-starlette starlette
supervisor tokenspeed-mla torch-c-dlpack-ext truststore typing-inspection uvicorn watchfiles websockets xgrammar
""".split()

# Native libraries a dense bf16 model on Hopper does not load (it uses FA3 and _C): 304 MB wheel → ~105 MB.
DROPPED = ["vllm/vllm_flash_attn/_vllm_fa2_C*", "vllm/_moe_C_stable_libtorch*", "vllm/_flashmla*",
           "vllm/_qutlass_C*", "vllm/third_party/deep_gemm"]


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pip(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args], stderr=subprocess.PIPE,
                          text=True)
    noise = ("WARNING: Location", "WARNING: Skipping")
    sys.stderr.write("".join(line + "\n" for line in done.stderr.splitlines() if not line.startswith(noise)))
    if done.returncode != 0:
        raise SystemExit(f"gpu-prepare: pip {args[0]} failed")


HOST_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "platform_machine": "x86_64",
            "platform_system": "Linux", "sys_platform": "linux", "os_name": "posix", "implementation_name": "cpython",
            "platform_python_implementation": "CPython", "extra": ""}


def _requirements(wheel: Path) -> list[Requirement]:
    """A wheel's requirements that apply on the host (markers evaluated there, no extras)."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(metadata).decode().splitlines()
    found = [Requirement(line.split(":", 1)[1].strip()) for line in lines if line.startswith("Requires-Dist:")]
    return [r for r in found if r.marker is None or r.marker.evaluate(HOST_ENV)]


def download(specs: list[str], cache: Path) -> None:
    pip("download", "--quiet", "--no-deps", *HOST_TAGS, "-d", str(cache), *specs)


def _versions(name: str) -> list[Version]:
    """Every release of ``name`` on the index, newest first."""
    done = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "--pre", name, "--disable-pip-version-check"],
                          capture_output=True, text=True)
    line = next((l for l in done.stdout.splitlines() if l.startswith("Available versions:")), "")
    return sorted((Version(v.strip()) for v in line.split(":", 1)[1].split(",") if v.strip()), reverse=True) if line else []


def _wheel(cache: Path, name: str, version: Version) -> Path | None:
    found = [w for w in cache.glob("*.whl") if normalize(w.name.split("-")[0]) == name
             and Version(w.name.split("-")[1]) == version]
    if not found:
        try:
            download([f"{name}=={version}"], cache)
        except SystemExit:
            return None  # no wheel of that release for the host
        return _wheel(cache, name, version)
    return found[0]


def resolve(version: str, cache: Path) -> dict[str, Path]:
    """vLLM and what the host lacks of its stack: name → wheel, every requirement among them met.

    A whole-closure ``pip`` resolve is not possible here (torch's CUDA wheels' pins are not all on the
    index, and the host has torch anyway), so this resolves only the packages the host lacks: start
    from the newest release each allows under vLLM's specifiers; while some chosen wheel requires
    another chosen package at a version it does not have, step the requiring package down to its next
    older release (vLLM's own pins stay fixed)."""
    vllm_wheel = _wheel(cache, "vllm", Version(version))
    if vllm_wheel is None:
        raise SystemExit(f"gpu-prepare: no wheel of vllm=={version}")
    limits = {normalize(r.name): r.specifier for r in _requirements(vllm_wheel) if normalize(r.name) in HOST_LACKS}
    chosen: dict[str, Path] = {}
    candidates: dict[str, list[Version]] = {}
    for name in HOST_LACKS:
        fitting = [v for v in _versions(name) if limits.get(name, SpecifierSet()).contains(v, prereleases=True)]
        # final releases first; some packages (opentelemetry's semantic conventions) publish only betas
        candidates[name] = [v for v in fitting if not v.is_prerelease] or fitting
        if not candidates[name]:
            raise SystemExit(f"gpu-prepare: no release of {name} fits vllm {version}")
    for name in HOST_LACKS:
        chosen[name] = _next_wheel(cache, name, candidates)
    for _ in range(200):
        conflict = _first_conflict(chosen)
        if conflict is None:
            return {"vllm": vllm_wheel, **chosen}
        requiring, requirement = conflict
        print(f"gpu-prepare: {chosen[requiring].name} needs {requirement}: trying an older {requiring}", file=sys.stderr)
        chosen[requiring] = _next_wheel(cache, requiring, candidates)
    raise SystemExit("gpu-prepare: the requirements between the chosen wheels do not settle")


def _next_wheel(cache: Path, name: str, candidates: dict[str, list[Version]]) -> Path:
    """The newest remaining candidate release of ``name`` with a wheel for the host (consumed)."""
    while candidates[name]:
        wheel = _wheel(cache, name, candidates[name].pop(0))
        if wheel is not None:
            return wheel
    raise SystemExit(f"gpu-prepare: no release of {name} satisfies the others")


def _first_conflict(chosen: dict[str, Path]) -> tuple[str, Requirement] | None:
    versions = {name: Version(wheel.name.split("-")[1]) for name, wheel in chosen.items()}
    for name, wheel in chosen.items():
        for requirement in _requirements(wheel):
            other = normalize(requirement.name)
            if other in versions and requirement.specifier and versions[other] not in requirement.specifier:
                return name, requirement
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle")
    parser.add_argument("--version", default="0.26.0")
    parser.add_argument("--part-mib", type=int, default=62)
    args = parser.parse_args()
    bundle = Path(args.bundle).resolve()
    cache, out = bundle / "vllm-cache", bundle / "vllm"
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="coldsnap-vllm-") as scratch:
        work = Path(scratch)
        print(f"gpu-prepare: vllm=={args.version} and {len(HOST_LACKS)} packages the host lacks (Python 3.12, "
              f"manylinux x86_64) into {cache}", file=sys.stderr)
        chosen = resolve(args.version, cache)
        wanted = {name: wheel.name.split("-")[1] for name, wheel in chosen.items()}
        wheels = list(chosen.values())
        site = work / "site"
        print(f"gpu-prepare: staging {len(wheels)} wheels (no compile) into a site tree", file=sys.stderr)
        pip("install", "--quiet", "--no-deps", "--no-compile", "--no-index", "--target", str(site), *HOST_TAGS,
            *map(str, wheels))
        dropped = 0
        for pattern in DROPPED:
            for path in site.glob(pattern):
                dropped += sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        shutil.rmtree(site / "bin", ignore_errors=True)
        print(f"gpu-prepare: dropped {dropped / 1e6:.0f} MB of libraries a dense bf16 model on Hopper does not load",
              file=sys.stderr)
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        archive = work / "vllm-site.tar.gz"
        subprocess.run(["tar", "-C", str(site), "-czf", str(archive), "."], check=True)
        digest = hashlib.sha256(archive.read_bytes()).hexdigest()
        part_bytes = args.part_mib * 2**20
        parts = []
        with archive.open("rb") as source:
            while chunk := source.read(part_bytes):
                part = out / f"vllm-site.tar.gz.part{len(parts):02d}"
                part.write_bytes(chunk)
                parts.append(part.name)
        manifest = {"vllm": args.version, "packages": wanted, "archive_sha256": digest,
                    "archive_bytes": archive.stat().st_size, "parts": parts, "dropped": DROPPED}
        (out / "vllm-site.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    print(f"gpu-prepare: {manifest['archive_bytes'] / 2**20:.0f} MiB in {len(parts)} parts in {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
