"""The registry of every ``COLDSNAP_*`` variable: nothing unregistered in the code, one rule for booleans, the
docs table current, and command-line flags that never travel through the environment."""

import importlib.util
import os
import re
from pathlib import Path

import pytest

from coldsnap.settings import SETTINGS, Setting, SettingError, SettingsRegistry

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("coldsnap", "coldsnap_vllm", "coldsnap_sglang")
NAME = re.compile(r"COLDSNAP_[A-Z0-9_]*[A-Z0-9]")


def _product_sources():
    for package in PRODUCT:
        yield from sorted((ROOT / package).rglob("*.py"))


def test_every_coldsnap_name_in_the_code_is_registered():
    unregistered = sorted({f"{path.relative_to(ROOT)}: {name}" for path in _product_sources()
                           for name in NAME.findall(path.read_text()) if name not in SETTINGS})
    assert unregistered == [], "register these in coldsnap/settings.py (and regenerate docs/settings.md):\n" + \
        "\n".join(unregistered)


def test_the_docs_table_is_current():
    spec = importlib.util.spec_from_file_location("docs_settings", ROOT / "scripts" / "docs-settings.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.rendered(module.PAGE.read_text()) == module.PAGE.read_text(), "python scripts/docs-settings.py"


def test_no_command_writes_a_setting_into_the_environment():
    writes = [f"{path.relative_to(ROOT)}:{number}" for path in _product_sources()
              for number, line in enumerate(path.read_text().splitlines(), 1)
              if re.search(r"os\.environ\[[^\]]+\]\s*=|os\.environ\.setdefault\(\s*['\"]?COLDSNAP|putenv", line)
              and "COLDSNAP" in line or re.search(r"os\.environ\[\w*(_ENV|DIR)\]\s*=", line)]
    assert writes == []


def _registry(readers=("launcher",)):
    return SettingsRegistry([Setting("COLDSNAP_T", "flag", "1", "t", readers)])


@pytest.mark.parametrize("value, expected", [("1", True), ("true", True), ("YES", True), ("on", True), ("0", False),
                                             ("false", False), ("No", False), ("off", False), ("", True), (None, True)])
def test_one_rule_for_booleans(value, expected):
    environ = {} if value is None else {"COLDSNAP_T": value}
    assert _registry().flag("COLDSNAP_T", environ) is expected


def test_a_bad_boolean_is_an_error_for_the_launcher_and_a_warning_in_the_engine(caplog):
    with pytest.raises(SettingError, match="COLDSNAP_T='maybe': want one of 1, true"):
        _registry().flag("COLDSNAP_T", {"COLDSNAP_T": "maybe"})
    assert _registry(("agent",)).flag("COLDSNAP_T", {"COLDSNAP_T": "maybe"}) is True
    assert "COLDSNAP_T='maybe'" in caplog.text


def test_a_flag_given_to_this_process_is_seen_here_and_not_in_the_environment(monkeypatch):
    monkeypatch.delenv("COLDSNAP_CAPTURE_VERIFY", raising=False)
    SETTINGS.give("COLDSNAP_CAPTURE_VERIFY", "0")
    try:
        assert SETTINGS.flag("COLDSNAP_CAPTURE_VERIFY") is False and "COLDSNAP_CAPTURE_VERIFY" not in os.environ
    finally:
        SETTINGS.forget("COLDSNAP_CAPTURE_VERIFY")
    assert SETTINGS.flag("COLDSNAP_CAPTURE_VERIFY") is True


def test_only_what_the_engine_reads_reaches_it():
    assert SETTINGS.reaches_engine("COLDSNAP_CONTROL") and SETTINGS.reaches_engine("COLDSNAP_HYDRATE_THREADS")
    assert not SETTINGS.reaches_engine("COLDSNAP_STATE_DIR") and not SETTINGS.reaches_engine("COLDSNAP_UNKNOWN")
    with pytest.raises(KeyError, match="not a registered coldsnap setting"):
        SETTINGS.flag("COLDSNAP_UNKNOWN")
