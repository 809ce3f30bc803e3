"""The host-THP window of `coldsnap restore --host-thp` (coldsnap.snapshot.thp) on a stand-in sysfs file."""

import json

import pytest

from coldsnap.snapshot.thp import ThpError, host_thp_requested, huge_pages_for_the_fill, thp_mode


def _write_mode(path, mode):  # what the kernel's file shows after `echo mode > enabled`
    path.write_text(" ".join(f"[{m}]" if m == mode else m for m in ("always", "madvise", "never")) + "\n")


@pytest.fixture
def sysfs(tmp_path, monkeypatch):
    path = tmp_path / "enabled"
    _write_mode(path, "madvise")
    monkeypatch.setattr("coldsnap.snapshot.thp._set_mode", _write_mode)
    return path


def test_the_window_sets_always_and_puts_back_the_mode_it_found(tmp_path, sysfs):
    with huge_pages_for_the_fill(tmp_path / "state", sysfs) as before:
        assert before == "madvise" and thp_mode(sysfs) == "always"
    assert thp_mode(sysfs) == "madvise"
    assert not (tmp_path / "state" / "host-thp.json").exists()


def test_overlapping_windows_restore_the_mode_when_the_last_one_ends(tmp_path, sysfs):
    state = tmp_path / "state"
    outer = huge_pages_for_the_fill(state, sysfs)
    outer.__enter__()
    with huge_pages_for_the_fill(state, sysfs) as before:
        assert before == "madvise"  # the mode found by the first window, not its own always
    assert thp_mode(sysfs) == "always"  # the outer window still holds it
    outer.__exit__(None, None, None)
    assert thp_mode(sysfs) == "madvise"


def test_a_window_whose_holder_died_is_restored_by_the_next(tmp_path, sysfs):
    state = tmp_path / "state"
    state.mkdir()
    _write_mode(sysfs, "always")  # left by a restore killed mid-fill, which had found madvise
    (state / "host-thp.json").write_text(json.dumps({"previous": "madvise", "holders": [2 ** 22 + 12345]}))
    with huge_pages_for_the_fill(state, sysfs):
        pass
    assert thp_mode(sysfs) == "madvise"


def test_bad_requests_and_unreadable_modes_are_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("COLDSNAP_HOST_THP", "yes")
    with pytest.raises(ThpError, match="want one of always, off"):
        host_thp_requested()
    monkeypatch.setenv("COLDSNAP_HOST_THP", "always")
    assert host_thp_requested()
    with pytest.raises(ThpError, match="cannot read"):
        thp_mode(tmp_path / "absent")
