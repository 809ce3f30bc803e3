"""Type checking in CI: mypy is clean on the packages, and coldsnap/_C.pyi matches the built extension.

mypy reads its configuration (the files, the engines it never follows) from pyproject.toml's
[tool.mypy] and keeps its cache in the repository's ignored .mypy_cache. stubtest cannot see the
signatures of pybind11 functions (they carry theirs only in their docstrings), so beside it a test
compares each signature of the stub with the one pybind11 wrote into the docstring.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STUB = ROOT / "coldsnap" / "_C.pyi"
ALLOWLIST = Path(__file__).with_name("stubtest-allowlist.txt")
_no_default = object()  # a parameter without a default (None is a default)

needs_mypy = pytest.mark.skipif(importlib.util.find_spec("mypy") is None,
                                reason="mypy is not installed (it is in the dev extra: pip install -e '.[dev]')")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


@needs_mypy
def test_mypy_is_clean():
    result = _run("-m", "mypy")
    if result.returncode != 0:
        pytest.fail(f"mypy (exit {result.returncode}):\n{result.stdout}{result.stderr}", pytrace=False)


@needs_mypy
def test_stub_matches_the_extension(tmp_path):
    # stubtest checks non-incrementally but would still write .mypy_cache, under options of its own that
    # make the next mypy run start cold: it writes no cache at all.
    config = tmp_path / "stubtest.ini"
    config.write_text(f"[mypy]\npython_version = 3.11\ncache_dir = {os.devnull}\n", encoding="utf-8")
    result = _run("-m", "mypy.stubtest", "coldsnap._C", "--allowlist", str(ALLOWLIST), "--mypy-config-file", str(config))
    if result.returncode != 0:
        pytest.fail(f"stubtest coldsnap._C (exit {result.returncode}):\n{result.stdout}{result.stderr}", pytrace=False)


# ---- signatures: the stub against pybind11's docstrings --------------------------------------------


def _split_top_level(text: str) -> list[str]:
    """``text`` split at the commas outside brackets and quotes."""
    parts, depth, quote, current = [], 0, "", []
    for char in text:
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append("".join(current).strip())
            current = []
            continue
        current.append(char)
    if "".join(current).strip():
        parts.append("".join(current).strip())
    return parts


def _runtime_signature(name: str, doc: str | None) -> list[tuple[str, object]]:
    """(parameter, default or ``_no_default``) from the first line pybind11 wrote into ``doc``."""
    assert doc, f"{name} has no docstring: is it a pybind11 function?"
    line = doc.splitlines()[0]
    assert line.startswith(f"{name}(") and ") -> " in line, f"{name}: unexpected docstring {line!r}"
    params = []
    for part in _split_top_level(line[len(name) + 1:line.rindex(") -> ")]):
        head, has_default, default = part.partition(" = ")
        params.append((head.partition(":")[0].strip(), _literal(default) if has_default else _no_default))
    return params


def _literal(text: str) -> object:
    try:
        return ast.literal_eval(text)
    except ValueError:
        return text  # not a literal: compared only for presence


def _stub_signature(node: ast.FunctionDef) -> list[tuple[str, object]]:
    args = [*node.args.posonlyargs, *node.args.args]
    defaults: list[object] = [_no_default] * (len(args) - len(node.args.defaults)) + [
        d.value if isinstance(d, ast.Constant) else ... for d in node.args.defaults]
    params = list(zip((a.arg for a in args), defaults))
    params += [(a.arg, _no_default if d is None else (d.value if isinstance(d, ast.Constant) else ...))
               for a, d in zip(node.args.kwonlyargs, node.args.kw_defaults)]
    return params


def _stub_functions() -> dict[str, ast.FunctionDef]:
    """Every function and method of the stub (properties aside: stubtest checks those), by dotted name."""
    found: dict[str, ast.FunctionDef] = {}
    for node in ast.parse(STUB.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.FunctionDef):
            found[node.name] = node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and not any(
                        isinstance(d, ast.Name) and d.id == "property" for d in item.decorator_list):
                    found[f"{node.name}.{item.name}"] = item
    return found


def _matches(stub: list[tuple[str, object]], runtime: list[tuple[str, object]]) -> bool:
    if [n for n, _ in stub] != [n for n, _ in runtime]:
        return False
    for (_, s), (_, r) in zip(stub, runtime):
        if (s is _no_default) != (r is _no_default):
            return False
        if s is not _no_default and s is not ... and s != r:  # `...` in a stub: any default
            return False
    return True


def test_stub_signatures_match_the_docstrings():
    native = pytest.importorskip("coldsnap._C", reason="coldsnap._C is not built (python setup.py build_ext --inplace)")
    functions = _stub_functions()
    assert "hydrate" in functions and "StableRegion.__init__" in functions
    wrong = []
    for dotted, node in sorted(functions.items()):
        owner = native
        for part in dotted.split(".")[:-1]:
            owner = getattr(owner, part)
        runtime = getattr(owner, node.name, None)
        if runtime is None:
            continue  # stubtest reports what the stub has and the extension lacks
        expected, actual = _runtime_signature(node.name, runtime.__doc__), _stub_signature(node)
        if not _matches(actual, expected):
            wrong.append(f"{dotted}: stub {_show(actual)}, extension {_show(expected)}")
    if wrong:
        pytest.fail("coldsnap/_C.pyi disagrees with the built extension:\n" + "\n".join(wrong), pytrace=False)


def _show(params: list[tuple[str, object]]) -> str:
    return "(" + ", ".join(n if d is _no_default else f"{n}={d!r}" for n, d in params) + ")"


def test_signature_check_sees_a_difference():
    runtime = _runtime_signature("f", "f(a: int, b: collections.abc.Sequence[tuple[int, int]] = [], c: str = 'x') -> None")
    assert runtime == [("a", _no_default), ("b", []), ("c", "x")]
    stub = ast.parse("def f(a: int, b: list[tuple[int, int]] = ..., c: str = 'x') -> None: ...").body[0]
    assert isinstance(stub, ast.FunctionDef) and _matches(_stub_signature(stub), runtime)
    for other in ("def f(a: int, c: str = 'x', b: list = ...) -> None: ...",  # order
                  "def f(a: int, b: list = ..., c: str = 'y') -> None: ...",  # default value
                  "def f(a: int, b: list = ..., *, c: str) -> None: ...",  # default missing
                  "def f(a: int, b: list = ...) -> None: ..."):  # parameter missing
        node = ast.parse(other).body[0]
        assert isinstance(node, ast.FunctionDef) and not _matches(_stub_signature(node), runtime), other
