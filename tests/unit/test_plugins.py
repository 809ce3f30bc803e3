"""Engine plugins: registered by entry points, importable without the engine, idempotent."""

from importlib.metadata import entry_points

import pytest

from coldsnap.plugin import PluginRegistration


@pytest.mark.parametrize(
    "group, package", [("vllm.general_plugins", "coldsnap_vllm"), ("sglang.srt.plugins", "coldsnap_sglang")]
)
def test_entry_point_is_installed_and_idempotent(group, package):
    found = [ep for ep in entry_points(group=group) if ep.name == "coldsnap"]
    assert len(found) == 1 and found[0].value == f"{package}:register"
    register = found[0].load()
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
    with pytest.raises(RuntimeError):
        failing()
    failing()  # a half-installed hook set is not installed again
    assert calls == [1, 2] and not failing.installed
