"""CRIU's restore logs in a replica's state directory (the newest kept), and when restores ask CRIU to fill huge pages."""

import os


def test_a_state_directory_keeps_only_the_newest_criu_restore_logs(tmp_path):
    from coldsnap.snapshot.criu_restore import KEPT_RESTORE_LOGS, drop_old_logs

    for index in range(KEPT_RESTORE_LOGS + 5):
        log = tmp_path / f"restore-{index:03d}.log"
        log.write_text("x")
        os.utime(log, ns=(index * 10**9, index * 10**9))
    (tmp_path / "restore.pid").write_text("1")
    drop_old_logs(tmp_path, "restore-*.log", KEPT_RESTORE_LOGS - 1)
    kept = sorted(p.name for p in tmp_path.glob("restore-*.log"))
    assert kept == [f"restore-{i:03d}.log" for i in range(6, KEPT_RESTORE_LOGS + 5)]
    assert (tmp_path / "restore.pid").exists()


def _balloon(root, features: str) -> None:
    device = root / "virtio0"
    device.mkdir(parents=True)
    (device / "features").write_text(features + "\n")


def test_the_huge_page_fill_is_off_by_default_where_the_balloon_reports_free_pages(tmp_path, monkeypatch):
    from coldsnap.snapshot.criu_binary import reports_free_pages, thp_fill_wanted

    monkeypatch.delenv("COLDSNAP_CRIU_THP_FILL", raising=False)
    reporting, plain, none = tmp_path / "reporting", tmp_path / "plain", tmp_path / "none"
    _balloon(reporting, "0110010100" + "0" * 54)  # bit 5: VIRTIO_BALLOON_F_REPORTING (this CPU machine's)
    _balloon(plain, "0110000100" + "0" * 54)
    assert reports_free_pages(reporting) and not reports_free_pages(plain) and not reports_free_pages(none)
    assert not thp_fill_wanted(reporting) and thp_fill_wanted(plain) and thp_fill_wanted(none)
    monkeypatch.setenv("COLDSNAP_CRIU_THP_FILL", "1")
    assert thp_fill_wanted(reporting)
    monkeypatch.setenv("COLDSNAP_CRIU_THP_FILL", "0")
    assert not thp_fill_wanted(plain)


def test_the_fill_threads_are_half_the_cpus_less_one_unless_set(monkeypatch):
    from coldsnap.snapshot import criu_binary as criu

    monkeypatch.delenv(criu.FILL_THREADS_ENV, raising=False)
    for cpus, helpers in ((1, 1), (2, 1), (4, 1), (8, 3), (16, 7), (128, 7)):
        monkeypatch.setattr(criu.os, "sched_getaffinity", lambda pid, n=cpus: set(range(n)))
        assert criu.fill_threads_wanted() == helpers, cpus
    monkeypatch.setenv(criu.FILL_THREADS_ENV, "0")
    assert criu.fill_threads_wanted() == 0  # CRIU's own one-thread fill
    monkeypatch.setenv(criu.FILL_THREADS_ENV, "40")
    assert criu.fill_threads_wanted() == criu.FILL_THREADS_MAX  # the patch's limit per process
