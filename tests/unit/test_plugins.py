"""Engine plugins: registered by entry points, importable without the engine, idempotent."""

from importlib.metadata import entry_points
from importlib.util import find_spec

import pytest

from coldsnap.plugin import PluginRegistration


@pytest.mark.parametrize(
    "group, package, engine",
    [("vllm.general_plugins", "coldsnap_vllm", "vllm"), ("sglang.srt.plugins", "coldsnap_sglang", "sglang")],
)
def test_entry_point_is_installed_and_idempotent(group, package, engine):
    found = [ep for ep in entry_points(group=group) if ep.name == "coldsnap"]
    assert len(found) == 1 and found[0].value == f"{package}:register"
    register = found[0].load()  # loading the entry point never needs the engine
    if find_spec(engine) is None:
        pytest.skip(f"{engine} is not installed here (tests/integration/test_vllm_cpu.py and test_sglang_hooks.py "
                    "register it in their venvs)")
    register()
    register()
    assert register.installed


def test_install_runs_once_and_failure_is_not_retried():
    calls = []
    registration = PluginRegistration("test", lambda: calls.append(1))
    for _ in range(3):
        registration()
    assert calls == [1]

    def broken():
        calls.append(2)
        raise RuntimeError("hook target moved")

    failing = PluginRegistration("test", broken)
    failing()  # never raises into the engine: one warning, the engine runs without coldsnap
    failing()  # a half-installed hook set is not installed again
    assert calls == [1, 2] and not failing.installed


def _write_module(folder, name, body="VALUE = 1\n"):
    (folder / f"{name}.py").write_text(body)


def test_after_import_runs_the_hook_when_the_engine_imports_the_module(tmp_path, monkeypatch):
    import importlib
    import inspect
    import sys

    from coldsnap.plugin import after_import

    _write_module(tmp_path, "coldsnap_hooked_mod", "def source_me():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    after_import("coldsnap_hooked_mod", seen.append)
    assert seen == []  # not imported yet: nothing runs, nothing is imported for it
    module = importlib.import_module("coldsnap_hooked_mod")
    try:
        assert seen == [module]
        assert inspect.getsource(module.source_me).startswith("def source_me")  # the original loader's
        after_import("coldsnap_hooked_mod", seen.append)  # already imported: at once
        assert seen == [module, module]
    finally:
        sys.modules.pop("coldsnap_hooked_mod", None)


def test_a_failing_hook_warns_and_the_import_succeeds(tmp_path, monkeypatch, caplog):
    import importlib
    import sys

    from coldsnap.plugin import after_import

    _write_module(tmp_path, "coldsnap_hooked_bad")
    monkeypatch.syspath_prepend(str(tmp_path))

    def broken(module):
        raise AttributeError("no Worker here")

    after_import("coldsnap_hooked_bad", broken)
    try:
        with caplog.at_level("WARNING", logger="coldsnap.plugin"):
            assert importlib.import_module("coldsnap_hooked_bad").VALUE == 1
        assert "no Worker here" in caplog.text
    finally:
        sys.modules.pop("coldsnap_hooked_bad", None)
