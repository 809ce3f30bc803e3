"""An inference engine for the offline GPU test host, as parts a device call can carry (`gpu-prepare.sh --vllm|--sglang`).

    python3 scripts/gpu-prepare-engine.py ENGINE BUNDLE_DIR [--part-mib 56] [--version V]

ENGINE is ``vllm`` (0.26.0) or ``sglang`` (0.5.17): the releases that pin the host's torch 2.11.0 and are
CUDA 13 builds (docs/design.md). The host has Python 3.12 with torch 2.11.0+cu130 and much of
their stack (KINDS.md, "Python packages already there"). For the engine's ``PROFILES`` entry this
resolves the packages the host lacks (``host_lacks``: what an engine's server start imports and the host
does not have, or has at a version the engine refuses) against the engine's own requirements (Python
3.12, manylinux x86_64, wheels only), downloads them, installs them into a staging tree (no compilation:
`--target` with the host's tags), drops the native libraries and data a dense bf16 model on Hopper never
loads (``dropped``), and writes the tree as one tar.gz split into parts of at most ``--part-mib`` MiB:
``BUNDLE_DIR/ENGINE/ENGINE-site.tar.gz.partNN`` plus ``ENGINE-site.json`` (versions, what was dropped
and left out and why, sizes, SHA-256 of the whole). ``scripts/gpu-engine.sh ENGINE`` puts it together on
the host. Downloads are cached in ``BUNDLE_DIR/ENGINE-cache``.
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
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

HOST_TAGS = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:",
             *[a for p in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64",
                           "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
                           "manylinux1_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "linux_x86_64",
                           "any") for a in ("--platform", p)]]

@dataclass(frozen=True)
class Profile:
    version: str
    host_lacks: list[str]  # normalized names
    dropped: list[str]  # globs in the site tree: libraries and data a dense bf16 model on Hopper does not load
    left_out: dict[str, str] = field(default_factory=dict)  # the engine's requirements not carried, and why


PROFILES = {
    # vLLM 0.26: what the project found a `vllm serve` of a dense model to
    # need. Dropping its other natives (it uses FA3 and _C) takes the 304 MB wheel to ~105 MB.
    "vllm": Profile(
        version="0.26.0",
        host_lacks="""
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
""".split(),
        dropped=["vllm/vllm_flash_attn/_vllm_fa2_C*", "vllm/_moe_C_stable_libtorch*", "vllm/_flashmla*",
                 "vllm/_qutlass_C*", "vllm/third_party/deep_gemm"],
    ),
    # SGLang 0.5.17, for `python3 -m sglang.launch_server --attention-backend triton --sampling-backend pytorch`.
    # host_lacks was traced, not read off its ~60 requirements: on a CPU box (Python 3.11, torch CPU, once
    # with torch claiming an sm_90 GPU) the server, tokenizer, detokenizer, scheduler, model runner, Llama,
    # Triton backend, CUDA graph runner, model loader and xgrammar modules were imported, every distribution
    # they loaded was listed, and each one the host lacks was hidden in turn to keep only those whose absence
    # breaks an import. transformers and tokenizers are here for their versions: sglang pins
    # transformers==5.12.1, which refuses at import the host's tokenizers 0.23.2 (it wants <=0.23.0); the
    # site comes first on PYTHONPATH, so these win for SGLang runs only. Speculative decoding (EAGLE,
    # STANDALONE) imports more when it captures the draft-extend graphs: the list of graph-capable attention
    # backends imports dsa_backend, which imports deep_gemm (sgl-deep-gemm) unguarded on CUDA, found on the
    # H200 by a STANDALONE start; DeepGEMM builds its _C with the host's nvcc at first import
    # (scripts/gpu-engine.sh install does it once).
    "sglang": Profile(
        version="0.5.17",
        host_lacks="""
annotated-types apache-tvm-ffi cffi compressed-tensors dill distro fastapi flashinfer-python gguf ipython jsonschema
jsonschema-specifications loguru msgspec openai opentelemetry-api orjson partial-json-parser pybase64 pydantic
pydantic-core python-multipart pyzmq referencing rpds-py setproctitle sglang-kernel sgl-deep-gemm sniffio soundfile
starlette tokenizers traitlets transformers typing-inspection uvicorn xgrammar
""".split(),
        dropped=[
            "sgl_kernel/flash_ops*",  # its FA3 (1.1 GB), imported only by sgl_kernel.flash_attn
            "sgl_kernel/sm100",  # common_ops for every GPU but sm_90; the H200 loads sm90/
            "sgl_kernel/flashmla_ops*",  # imported only by sgl_kernel.flash_mla (MLA models), in a try
            "sgl_kernel/infllm_ops*",  # loaded on first use by the InfLLM-V2 attention only
            "xgrammar/lib",  # libxgrammar.a, a static archive for C++ builds; Python loads the bindings .so
            "sglang/multimodal_gen",  # the diffusion runtime (`sglang generate`), not imported by launch_server
            "sglang/srt/server",  # the Rust HTTP server's _core, loaded only with SGLANG_RUST_SERVER=1
        ],
        left_out={
            "flash-attn-4": "imported only by the FA4 attention backend (try/except elsewhere)",
            "tilelang": "not imported at server start (DeepSeek sparse-attention kernels)",
            "helion": "not imported at server start",
            "nvidia-cutlass-dsl": "CuTe DSL kernels (FA4, some MoE/quant paths); its imports are guarded",
            "nvidia-mathdx": "not imported at server start",
            "torchao": "import guarded; only its quantization options use it",
            "quack-kernels": "not imported at server start",
            "tokenspeed-mla": "imported only by the tokenspeed MLA attention backend",
            "humming-kernels": "not imported at server start",
            "kernels": "import guarded (HF kernels hub)",
            "torch-memory-saver": "imported only with --enable-memory-saver",
            "llguidance": "imported only by the llguidance grammar backend (--grammar-backend llguidance)",
            "outlines": "imported only by the outlines grammar backend; xgrammar is the default",
            "mistral-common": "optional for transformers; only Mistral (tekken) tokenizers use it",
            "modelscope": "only with SGLANG_USE_MODELSCOPE",
            "datasets": "benchmarks only",
            "blobfile": "not imported at server start",
            "easydict": "not imported at server start",
            "py-spy": "a profiler binary, not imported",
            "smg-grpc-servicer": "only the gRPC server (--grpc-mode)",
            "openai-harmony": "gpt-oss models only; import guarded",
            "interegular": "outlines backend only",
            "watchfiles": "uvicorn --reload only",
            "zstandard": "import guarded",
            "torchcodec": "video inputs only; import guarded",
            "cuda-python": "a metapackage; the host's cuda-bindings provides the modules",
            "torch, torchaudio, torchvision, triton, numba, timm, numpy, pillow, requests, scipy, einops, ...":
                "the host has them (KINDS.md)",
            "jaraco-*, more-itertools, backports-tarfile": "imported via setuptools, which vendors them on the host",
        },
    ),
}


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
    line = next((text for text in done.stdout.splitlines() if text.startswith("Available versions:")), "")
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


def resolve(engine: str, profile: Profile, version: str, cache: Path) -> dict[str, Path]:
    """The engine and what the host lacks of its stack: name → wheel, every requirement among them met.

    A whole-closure ``pip`` resolve is not possible here (torch's CUDA wheels' pins are not all on the
    index, and the host has torch anyway), so this resolves only the packages the host lacks: start
    from the newest release each allows under the engine's specifiers and those of the packages it pins
    exactly (sglang's transformers==5.12.1 bounds tokenizers); while some chosen wheel requires another
    chosen package at a version it does not have, step one of them down (the engine's own pins stay
    fixed): the required package to the newest release the requirement allows where an older one does
    (it is too new: a pin or upper bound), else the requiring package to its next older release."""
    engine_wheel = _wheel(cache, engine, Version(version))
    if engine_wheel is None:
        raise SystemExit(f"gpu-prepare: no wheel of {engine}=={version}")
    lacks = profile.host_lacks
    limits = {normalize(r.name): r.specifier for r in _requirements(engine_wheel) if normalize(r.name) in lacks}
    for name, specifier in list(limits.items()):
        pinned = [s.version for s in specifier if s.operator == "=="]
        pinned_wheel = _wheel(cache, name, Version(pinned[0])) if pinned else None
        for requirement in _requirements(pinned_wheel) if pinned_wheel else []:
            other = normalize(requirement.name)
            if other in lacks:
                limits[other] = limits.get(other, SpecifierSet()) & requirement.specifier
    chosen: dict[str, Path] = {}
    candidates: dict[str, list[Version]] = {}
    for name in lacks:
        fitting = [v for v in _versions(name) if limits.get(name, SpecifierSet()).contains(v, prereleases=True)]
        # final releases first; some packages (opentelemetry's semantic conventions) publish only betas
        candidates[name] = [v for v in fitting if not v.is_prerelease] or fitting
        if not candidates[name]:
            raise SystemExit(f"gpu-prepare: no release of {name} fits {engine} {version}")
    for name in lacks:
        chosen[name] = _next_wheel(cache, name, candidates)
    for _ in range(200):
        conflict = _first_conflict(chosen)
        if conflict is None:
            return {engine: engine_wheel, **chosen}
        requiring, requirement = conflict
        required = normalize(requirement.name)
        # Stepping the requiring package down never mends a required one that is too new: opentelemetry-api
        # 1.45.3 came out without an sdk, and every opentelemetry-sdk pins the api of its own release
        # (==1.45.2), so no older sdk takes 1.45.3 and the sdk ran out of releases. Step the required down.
        allowed = [v for v in candidates[required] if v in requirement.specifier]
        if allowed:
            print(f"gpu-prepare: {chosen[requiring].name} needs {requirement}: trying {required} {allowed[0]}",
                  file=sys.stderr)
            del candidates[required][:candidates[required].index(allowed[0])]
            chosen[required] = _next_wheel(cache, required, candidates)
            continue
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
    parser.add_argument("engine", choices=sorted(PROFILES))
    parser.add_argument("bundle")
    parser.add_argument("--version", help="the engine's release (default: the profile's)")
    # A device call carries 64 MiB in all, the checkout included: 56 MiB parts stopped fitting at ~9 MB of checkout
    # (2026-12-03), 52 MiB ones at ~12.4 MB (2026-12-06, most of it benchmarks/results).
    parser.add_argument("--part-mib", type=int, default=44)
    args = parser.parse_args()
    engine, profile = args.engine, PROFILES[args.engine]
    version = args.version or profile.version
    bundle = Path(args.bundle).resolve()
    cache, out = bundle / f"{engine}-cache", bundle / engine
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"coldsnap-{engine}-") as scratch:
        work = Path(scratch)
        print(f"gpu-prepare: {engine}=={version} and {len(profile.host_lacks)} packages the host lacks (Python 3.12, "
              f"manylinux x86_64) into {cache}", file=sys.stderr)
        chosen = resolve(engine, profile, version, cache)
        wanted = {name: wheel.name.split("-")[1] for name, wheel in chosen.items()}
        wheels = list(chosen.values())
        site = work / "site"
        print(f"gpu-prepare: staging {len(wheels)} wheels (no compile) into a site tree", file=sys.stderr)
        pip("install", "--quiet", "--no-deps", "--no-compile", "--no-index", "--target", str(site), *HOST_TAGS,
            *map(str, wheels))
        dropped = 0
        for pattern in profile.dropped:
            matched = list(site.glob(pattern))
            if not matched:  # a new release moved it: say so rather than ship it unnoticed
                raise SystemExit(f"gpu-prepare: nothing in the site matches {pattern}")
            for path in matched:
                dropped += sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        shutil.rmtree(site / "bin", ignore_errors=True)
        print(f"gpu-prepare: dropped {dropped / 1e6:.0f} MB of libraries a dense bf16 model on Hopper does not load",
              file=sys.stderr)
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        archive = work / f"{engine}-site.tar.gz"
        subprocess.run(["tar", "-C", str(site), "-czf", str(archive), "."], check=True)
        digest = hashlib.sha256(archive.read_bytes()).hexdigest()
        part_bytes = args.part_mib * 2**20
        parts = []
        with archive.open("rb") as source:
            while chunk := source.read(part_bytes):
                part = out / f"{engine}-site.tar.gz.part{len(parts):02d}"
                part.write_bytes(chunk)
                parts.append(part.name)
        manifest = {"engine": engine, engine: version, "packages": wanted, "archive_sha256": digest,
                    "archive_bytes": archive.stat().st_size, "parts": parts, "dropped": profile.dropped,
                    "left_out": profile.left_out}
        (out / f"{engine}-site.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    print(f"gpu-prepare: {manifest['archive_bytes'] / 2**20:.0f} MiB in {len(parts)} parts in {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
