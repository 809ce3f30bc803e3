"""The import rules of docs/design.md ("Parts and import rules"), checked on the source of every module.

Arrows go down: cli → activation → {snapshot, coord, contracts, agent protocol, hydrate}; agent →
{memory, payload, hydrate, collective, coord}; plugins → {agent, memory, payload, hydrate, collective,
contracts}. Never: core → a plugin; contracts → any runtime part; coord → snapshot or memory; agent →
activation; a lower part (memory, payload, hydrate, snapshot, coord, collective) → agent; one plugin →
the other.

A part is ``coldsnap/<part>/`` or ``coldsnap/<part>.py``; the plugins are ``coldsnap_vllm`` and
``coldsnap_sglang``. Every import counts, wherever it is (module level, inside a function, under
``TYPE_CHECKING``), as does ``importlib.import_module("literal")``. What is checked:

- the "Never" list above, plus two that guard the activation → agent arrow: the launcher side (any
  core part but the agent itself and the reference workload, which plays an engine) reaches the agent
  only through its protocol and client, and those two import nothing else of coldsnap (so the server
  never comes in behind them);
- "arrows go down": only ``coldsnap.__main__`` imports the CLI and only the CLI (and ``coldsnap.demo``,
  which it runs) imports activation;
- the agent's and the plugins' arrows are exhaustive: besides the parts listed they may import only
  ``contracts`` and the shared leaf modules (:data:`SHARED`). The activation's arrow is not (the
  launcher also stages memory, verifies payloads, runs the doctor's probes and the operation runner);
- no engine (vLLM, SGLang) in core: ``import coldsnap`` imports no engine, and the reference workload
  is torch, not an engine; contracts import no torch either;
- no circle: no module imports one that imports it back, directly or through others (every import
  counts, as above; ``from a.b import c`` is an edge to the module ``a.b.c`` where that is one, else to
  ``a.b``).

A rule broken on purpose goes into :data:`ALLOWED` with its reason; an entry that no longer matches an
import fails the test, so the list cannot go stale.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("coldsnap", "coldsnap_vllm", "coldsnap_sglang")
PLUGINS = frozenset({"coldsnap_vllm", "coldsnap_sglang"})
ENGINES = frozenset({"vllm", "sglang"})
LOWER = frozenset({"memory", "payload", "hydrate", "snapshot", "coord", "collective"})
# Leaf modules every part may use: the package root (``__version__``), the extension and its loader,
# atomic writes, timing, progress lines, the plugin-registration helper, host facts, the COLDSNAP_* settings.
SHARED = frozenset({"(root)", "_C", "native", "atomic", "timing", "progress", "plugin", "host", "settings"})
AGENT_ARROWS = frozenset({"memory", "payload", "hydrate", "collective", "coord", "contracts"}) | SHARED
PLUGIN_ARROWS = frozenset({"agent", "memory", "payload", "hydrate", "collective", "contracts"}) | SHARED
# What the launcher side (activation) may import of the agent; all three are dependency-free (addresses: the
# control names' socket addresses, which a restore's entry needs before pydantic, protocol's import, is loaded).
AGENT_LAUNCHER_SIDE = ("coldsnap.agent.protocol", "coldsnap.agent.client", "coldsnap.agent.addresses")

# (importing module, imported name or a package prefix of it) → why the rule is broken on purpose.
ALLOWED: dict[tuple[str, str], str] = {
    ("coldsnap.__main__", "coldsnap.activation.early_wake.start_prefill"):
        "`coldsnap wake` asks the standby to start filling its weights before the CLI's imports (the module "
        "uses the standard library only)",
    ("coldsnap.__main__", "coldsnap.activation.early_restore.start_tree"):
        "`coldsnap restore` starts CRIU before the CLI's imports (the module uses the standard library only; the "
        "full admission adopts or kills the tree)",
    ("coldsnap.activation.early_restore", "coldsnap.cli.flags.restore_arguments"):
        "the fast entry parses `coldsnap restore`'s argv with the CLI's own definition of its flags, so that a "
        "flag is defined once for both ways into a restore (the module uses the standard library only)",
}


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    line: int
    target: str  # fully resolved: ``from a.b import c`` is ``a.b.c`` (a submodule or a name of a.b)


@dataclass(frozen=True)
class Violation:
    imp: Import
    rule: str

    def __str__(self) -> str:
        return f"{self.imp.module}:{self.imp.line}: imports {self.imp.target} ({self.rule})"


def module_name(path: Path, root: Path) -> tuple[str, bool]:
    """The dotted name of ``path`` (relative to ``root``) and whether it is a package's ``__init__``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts.pop()
    return ".".join(parts), is_package


def imports_of(source: str, module: str, is_package: bool) -> list[Import]:
    """Every import in ``source``, at any depth, relative ones resolved against ``module``."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [Import(module, node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                if node.level - 1 >= len(base):
                    raise ValueError(f"{module}:{node.lineno}: relative import beyond the top-level package")
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            found += [Import(module, node.lineno, f"{origin}.{alias.name}" if alias.name != "*" else origin)
                      for alias in node.names]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and (getattr(node.func, "attr", None) == "import_module" or getattr(node.func, "id", None)
                   in ("import_module", "__import__"))):
            found.append(Import(module, node.lineno, node.args[0].value))
    return found


def part_of(name: str) -> str | None:
    """The part a dotted name belongs to: ``coldsnap.<part>...``, ``(root)`` for the package itself or
    a name defined there, a plugin's package name; None outside the project."""
    head, _, rest = name.partition(".")
    if head in PLUGINS:
        return head
    if head != "coldsnap":
        return None
    part = rest.partition(".")[0]
    return part if part and part != "__version__" else "(root)"


def violations(imp: Import) -> list[str]:
    """The rules ``imp`` breaks (their names)."""
    source, target = part_of(imp.module), part_of(imp.target)
    third_party = imp.target.partition(".")[0]
    broken = []
    if source is None:
        return broken
    if source not in PLUGINS:
        if target in PLUGINS:
            broken.append("core → a plugin")
        if third_party in ENGINES:
            broken.append("core → an engine")
    if source in PLUGINS and target in PLUGINS and source != target:
        broken.append("one plugin → the other")
    if source == "contracts":
        if target is not None and target not in ("contracts", "(root)"):
            broken.append("contracts → a runtime part")
        if third_party == "torch":
            broken.append("contracts → torch")
    if source == "coord" and target in ("snapshot", "memory"):
        broken.append(f"coord → {target}")
    if source == "agent" and target == "activation":
        broken.append("agent → activation")
    if source in LOWER and target == "agent":
        broken.append(f"lower part {source} → agent")
    if target == "agent" and source not in {"agent", "workloads"} | PLUGINS | LOWER \
            and not _within(imp.target, AGENT_LAUNCHER_SIDE):
        broken.append(f"{source} → agent other than its protocol and client")
    if _within(imp.module, AGENT_LAUNCHER_SIDE) and target is not None and target != "(root)" \
            and not _within(imp.target, AGENT_LAUNCHER_SIDE):
        broken.append("the agent's protocol and client import nothing else of coldsnap")
    if target == "cli" and imp.module != "coldsnap.__main__" and source != "cli":
        broken.append("upward: only coldsnap.__main__ imports the CLI")
    # `coldsnap demo` (coldsnap/demo.py) drives whole operations as the CLI does: it sits at the CLI's level
    if target == "activation" and source not in ("cli", "demo", "activation"):
        broken.append("upward: only the CLI (and the demo it runs) imports activation")
    if source == "agent" and target is not None and target not in AGENT_ARROWS | {"agent"}:
        broken.append("agent → " + target + " (not an arrow of the agent)")
    if source in PLUGINS and target is not None and target != source and target not in PLUGIN_ARROWS | PLUGINS:
        broken.append("plugin → " + target + " (not an arrow of the plugins)")
    return broken


def _within(name: str, prefixes: tuple[str, ...] | frozenset[str] | str) -> bool:
    if isinstance(prefixes, str):
        prefixes = (prefixes,)
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def project_imports(root: Path = ROOT) -> list[Import]:
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            module, is_package = module_name(path, root)
            found += imports_of(path.read_text(encoding="utf-8"), module, is_package)
    return found


def check(imports: list[Import], allowed: dict[tuple[str, str], str]) -> tuple[list[Violation], set[tuple[str, str]]]:
    """The violations not allowed, and the allow-list entries that were used."""
    left, used = [], set()
    for imp in imports:
        for rule in violations(imp):
            key = next((k for k in allowed if k[0] == imp.module and _within(imp.target, k[1])), None)
            if key is None:
                left.append(Violation(imp, rule))
            else:
                used.add(key)
    return left, used


def test_every_package_is_scanned():
    modules = {imp.module for imp in project_imports()}
    for expected in ("coldsnap.cli", "coldsnap.agent.server", "coldsnap.collective.group", "coldsnap_vllm.loader",
                     "coldsnap_sglang"):
        assert expected in modules


def test_import_rules_hold():
    left, used = check(project_imports(), ALLOWED)
    if left:
        pytest.fail("imports that break docs/design.md's import rules:\n" + "\n".join(map(str, left)), pytrace=False)
    stale = sorted(set(ALLOWED) - used)
    if stale:
        pytest.fail("allow-list entries that match no broken rule any more (remove them):\n"
                    + "\n".join(f"{module} → {target}" for module, target in stale), pytrace=False)


def test_allow_list_gives_reasons():
    assert all(reason.strip() for reason in ALLOWED.values())


@pytest.mark.parametrize(("module", "is_package", "source", "expected"), [
    # function-level, relative (one and two dots), `import x`, `from x import y`, import_module
    ("coldsnap.collective.group", False, "def f():\n    from ..agent.memory import ModelMemory\n",
     "coldsnap.agent.memory.ModelMemory"),
    ("coldsnap.collective", True, "from .. import agent\n", "coldsnap.agent"),
    ("coldsnap.coord.server", False, "import coldsnap.snapshot.criu\n", "coldsnap.snapshot.criu"),
    ("coldsnap.coord.server", False, "from . import frames\nfrom coldsnap.memory import reserve\n",
     "coldsnap.memory.reserve"),
    ("coldsnap.contracts.base", False, "if X:\n    import torch\n", "torch"),
    ("coldsnap.activation.capture", False, "from coldsnap.agent import start_agent\n", "coldsnap.agent.start_agent"),
    ("coldsnap.activation.capture", False, "from coldsnap.agent.server import AgentServer\n",
     "coldsnap.agent.server.AgentServer"),
    ("coldsnap.agent.client", False, "from coldsnap.agent.memory import ModelMemory\n",
     "coldsnap.agent.memory.ModelMemory"),
    ("coldsnap.agent.server", False, "from coldsnap.activation.ranks import T\n", "coldsnap.activation.ranks.T"),
    ("coldsnap.cli", False, "importlib.import_module('coldsnap_vllm.loader')\n", "coldsnap_vllm.loader"),
    ("coldsnap_vllm.loader", False, "from coldsnap_sglang import register\n", "coldsnap_sglang.register"),
    ("coldsnap_vllm.loader", False, "from coldsnap.snapshot import criu\n", "coldsnap.snapshot.criu"),
    ("coldsnap.memory.regions", False, "import vllm.config\n", "vllm.config"),
    ("coldsnap.payload.pack", False, "from coldsnap.cli import main\n", "coldsnap.cli.main"),
    ("coldsnap.doctor", False, "from coldsnap.agent.memory import ModelMemory\n", "coldsnap.agent.memory.ModelMemory"),
])
def test_checker_finds_what_the_rules_forbid(module, is_package, source, expected):
    found, _ = check(imports_of(source, module, is_package), {})
    assert expected in {v.imp.target for v in found}, found


@pytest.mark.parametrize(("module", "source"), [
    ("coldsnap.activation.capture", "from coldsnap.agent.client import AgentClient\nfrom coldsnap.agent import protocol\n"),
    ("coldsnap.agent.client", "from coldsnap.agent.protocol import Prepare\n"),
    ("coldsnap.agent.memory", "from coldsnap.timing import timed\nfrom coldsnap.contracts.layout import MemoryLayout\n"),
    ("coldsnap_vllm.loader", "from coldsnap.agent.server import AgentHooks\nfrom coldsnap.native import native\n"),
    ("coldsnap.contracts.receipt", "from coldsnap.contracts.base import Contract\nfrom coldsnap import __version__\n"),
    ("coldsnap.__main__", "from coldsnap.cli import main\n"),
    ("coldsnap.workloads.torch_lm.serve", "from coldsnap.agent.server import AgentHooks\n"),
])
def test_checker_lets_the_arrows_through(module, source):
    assert check(imports_of(source, module, False), {}) == ([], set())


def test_failure_message_names_module_import_and_rule():
    found, _ = check(imports_of("from coldsnap.agent.memory import timed\n", "coldsnap.collective.group", False), {})
    assert [str(v) for v in found] == [
        "coldsnap.collective.group:1: imports coldsnap.agent.memory.timed (lower part collective → agent)"]


def test_allow_list_entry_covers_a_prefix():
    imports = imports_of("from coldsnap.agent.memory import timed\n", "coldsnap.collective.group", False)
    left, used = check(imports, {("coldsnap.collective.group", "coldsnap.agent.memory"): "reason"})
    assert left == [] and used == {("coldsnap.collective.group", "coldsnap.agent.memory")}


def import_graph(imports: list[Import], modules: set[str]) -> dict[str, set[str]]:
    """Module → the project modules it imports (a name of a module is an edge to that module)."""
    graph: dict[str, set[str]] = {module: set() for module in modules}
    for imp in imports:
        target = imp.target
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != imp.module:
            graph[imp.module].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_itself_back():
    modules = {module_name(path, ROOT)[0] for package in PACKAGES for path in (ROOT / package).rglob("*.py")}
    found = circles(import_graph(project_imports(), modules))
    assert not found, "import circles (each group imports itself back): " + "; ".join(" ↔ ".join(c) for c in found)


def test_the_circle_check_finds_a_circle_through_a_function_level_import():
    imports = (imports_of("from coldsnap.activation.b import run\n", "coldsnap.activation.a", False)
               + imports_of("def f():\n    from coldsnap.activation import a\n", "coldsnap.activation.b", False))
    graph = import_graph(imports, {"coldsnap.activation", "coldsnap.activation.a", "coldsnap.activation.b"})
    assert circles(graph) == [["coldsnap.activation.a", "coldsnap.activation.b"]]
