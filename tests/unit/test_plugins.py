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
    if engine != "sglang" and find_spec(engine) is None:
        pytest.skip(f"{engine} is not installed here (tests/integration/test_vllm_cpu.py registers it in its venv)")
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
