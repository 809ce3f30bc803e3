"""Vendor the Kubernetes JSON schemas that tests/unit/test_kubernetes_manifests.py checks deploy/kubernetes/ against.

The schemas come from the kubernetes-validate wheel on PyPI, which ships the "local-strict" JSON schemas
of each Kubernetes release (generated from that release's OpenAPI document; strict: every object has
``additionalProperties: false``, so a misspelt field fails). This copies the schema of each kind given
and ``_definitions.json`` cut down to the definitions those kinds reach, each re-serialized with sorted
keys and nothing else changed, so the test runs offline with no 20 MB dependency:

    pip download --no-deps -d /tmp/wheels kubernetes-validate==1.37.0
    python scripts/vendor-kubernetes-schemas.py /tmp/wheels/kubernetes_validate-1.37.0-py3-none-any.whl \\
        v1.35.0 daemonset-apps-v1 deployment-apps-v1 job-batch-v1 secret-v1 service-v1

Writes deploy/kubernetes/schemas/<version>/ (replacing it); update its README.md by hand.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "kubernetes_validate/kubernetes-json-schema"
DEFINITIONS = "_definitions.json"


def _refs(node: object) -> set[str]:
    """Every ``$defs`` name a schema node refers to (``.../_definitions.json#/$defs/NAME`` or ``#/$defs/NAME``)."""
    found: set[str] = set()
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and "#/$defs/" in ref:
            found.add(ref.split("#/$defs/", 1)[1])
        for value in node.values():
            found |= _refs(value)
    elif isinstance(node, list):
        for value in node:
            found |= _refs(value)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", type=Path, help="kubernetes_validate-*.whl")
    parser.add_argument("version", help="e.g. v1.35.0 (a folder <version>-local-strict in the wheel)")
    parser.add_argument("kinds", nargs="+", help="schema names, e.g. deployment-apps-v1")
    args = parser.parse_args()
    folder = f"{PREFIX}/{args.version}-local-strict"
    out = ROOT / "deploy" / "kubernetes" / "schemas" / args.version
    with zipfile.ZipFile(args.wheel) as wheel:
        kinds = {kind: json.loads(wheel.read(f"{folder}/{kind}.json")) for kind in args.kinds}
        definitions = json.loads(wheel.read(f"{folder}/{DEFINITIONS}"))
    defs = definitions["$defs"]
    wanted: set[str] = set()
    todo = set().union(*(_refs(schema) for schema in kinds.values()))
    while todo:
        name = todo.pop()
        if name not in wanted:
            wanted.add(name)
            todo |= _refs(defs[name]) - wanted
    trimmed = {**definitions, "$defs": {name: defs[name] for name in sorted(wanted)}}
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for kind, schema in kinds.items():
        (out / f"{kind}.json").write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")
    (out / DEFINITIONS).write_text(json.dumps(trimmed, indent=1, sort_keys=True) + "\n")
    digest = hashlib.sha256(args.wheel.read_bytes()).hexdigest()
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"{out.relative_to(ROOT)}: {len(kinds)} kinds, {len(wanted)} of {len(defs)} definitions, {size} bytes; "
          f"from {args.wheel.name} (sha256 {digest})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
