"""CRIU's restore logs in a replica's state directory: the newest kept, the rest removed."""

import os


def test_a_state_directory_keeps_only_the_newest_criu_restore_logs(tmp_path):
    from coldsnap.snapshot.criu import KEPT_RESTORE_LOGS, _drop_old_logs

    for index in range(KEPT_RESTORE_LOGS + 5):
        log = tmp_path / f"restore-{index:03d}.log"
        log.write_text("x")
        os.utime(log, ns=(index * 10**9, index * 10**9))
    (tmp_path / "restore.pid").write_text("1")
    _drop_old_logs(tmp_path, "restore-*.log", KEPT_RESTORE_LOGS - 1)
    kept = sorted(p.name for p in tmp_path.glob("restore-*.log"))
    assert kept == [f"restore-{i:03d}.log" for i in range(6, KEPT_RESTORE_LOGS + 5)]
    assert (tmp_path / "restore.pid").exists()
