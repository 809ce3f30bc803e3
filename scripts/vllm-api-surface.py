"""Record which of the vLLM symbols coldsnap's plugin looks up exist in a vLLM wheel (read, not imported).

    python3 scripts/vllm-api-surface.py vllm-0.26.0-*.whl > tests/fixtures/vllm-0.26.0-surface.json

Reads each module's source from the wheel with ``ast`` — no install, no torch, no GPU — and answers, for
every symbol in ``coldsnap_vllm.compat.PROBED`` (``module:name`` or ``module:Class.member``), whether the
module defines or imports that name (and the class that member). tests/unit/test_vllm_compat.py feeds
the result to ``compat.probe`` to check which hooks the plugin picks on that release.
"""

from __future__ import annotations

import ast
import json
import re
import sys
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coldsnap_vllm.compat import PROBED  # noqa: E402  (imports no vLLM)


def _module_source(wheel: zipfile.ZipFile, module: str) -> str | None:
    base = module.replace(".", "/")
    for name in (f"{base}.py", f"{base}/__init__.py"):
        try:
            return wheel.read(name).decode()
        except KeyError:
            continue
    return None


def _top_level(tree: ast.Module) -> dict[str, ast.AST]:
    names: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name):
                    names[target.id] = node
    return names


def exists(wheel: zipfile.ZipFile, symbol: str) -> bool:
    module, _, path = symbol.partition(":")
    source = _module_source(wheel, module)
    if source is None:
        return False
    parts = path.split(".")
    node = _top_level(ast.parse(source)).get(parts[0])
    if node is None:
        return False
    if len(parts) == 1:
        return True
    if not isinstance(node, ast.ClassDef):
        return False  # imported classes are not followed (none of the probed members needs it)
    return parts[1] in _top_level(ast.Module(body=node.body, type_ignores=[]))


def main() -> int:
    wheel_path = Path(sys.argv[1])
    version = re.match(r"vllm(?:_cpu)?-([^-]+)-", wheel_path.name)
    with zipfile.ZipFile(wheel_path) as wheel:
        surface = {symbol: exists(wheel, symbol) for symbol in PROBED}
    json.dump({"vllm": version.group(1) if version else "unknown", "wheel": wheel_path.name, "symbols": surface},
              sys.stdout, indent=1, sort_keys=True)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
