"""Host facts admission keeps per boot: the `criu check` verdict (coldsnap.snapshot.criu_binary.checked_criu) and
the CUDA probe (coldsnap.snapshot.cuda_checkpoint.cached_probe_cuda)."""

import os
import stat

from coldsnap.snapshot import cuda_checkpoint
from coldsnap.snapshot.criu_binary import checked_criu


def _fake_criu(path, calls, verdict="Looks good.", gitid=""):
    version = "Version: 4.2.1" + (f"\\nGitID: {gitid}" if gitid else "")
    path.write_text(f"#!/bin/sh\necho run >> {calls}\n"
                    f"case \"$1\" in --version) printf '{version}\\n' ;; check) echo '{verdict}' ;; esac\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_a_passing_criu_check_is_reused_until_the_executable_changes(tmp_path, monkeypatch):
    criu, calls = tmp_path / "criu", tmp_path / "calls"
    _fake_criu(criu, calls, gitid="v4.2.1-coldsnap-thp-fill+parallel")
    monkeypatch.setenv("COLDSNAP_CRIU", str(criu))
    version = checked_criu(tmp_path)[0]
    assert version.numbers == (4, 2, 1) and version.fills_huge_pages and version.fills_in_parallel
    version, check = checked_criu(tmp_path)  # kept: the build's GitID too
    assert check.ok and version.fills_in_parallel and str(version) == "4.2.1 (v4.2.1-coldsnap-thp-fill+parallel)"
    assert len(calls.read_text().splitlines()) == 2  # --version and check, once
    os.utime(criu, ns=(1, 1))  # another executable (mtime changed): asked again
    checked_criu(tmp_path)
    assert len(calls.read_text().splitlines()) == 4


def test_a_stock_criu_does_not_fill_huge_pages(tmp_path, monkeypatch):
    criu, calls = tmp_path / "criu", tmp_path / "calls"
    _fake_criu(criu, calls)
    monkeypatch.setenv("COLDSNAP_CRIU", str(criu))
    version = checked_criu(tmp_path)[0]
    assert version.numbers == (4, 2, 1) and version.gitid == "" and not version.fills_huge_pages
    assert not version.fills_in_parallel


def test_a_failing_criu_check_is_never_kept(tmp_path, monkeypatch):
    criu, calls = tmp_path / "criu", tmp_path / "calls"
    _fake_criu(criu, calls, verdict="Error: no")
    monkeypatch.setenv("COLDSNAP_CRIU", str(criu))
    assert not checked_criu(tmp_path)[1].ok
    assert not checked_criu(tmp_path)[1].ok
    assert len(calls.read_text().splitlines()) == 4
    assert not (tmp_path / "criu-check.json").exists()


def test_the_cuda_probe_is_kept_per_boot_driver_and_visible_gpus(tmp_path, monkeypatch):
    probes = []

    def probe():
        probes.append(1)
        return {"available": True, "devices": [{"uuid": "GPU-1", "name": "NVIDIA H200"}], "checkpoint_api": True}

    monkeypatch.setattr(cuda_checkpoint, "probe_cuda", probe)
    monkeypatch.setattr("coldsnap.host.nvidia_kernel_driver", lambda: "580.159.04")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert cuda_checkpoint.cuda_devices(tmp_path)[0]["uuid"] == "GPU-1"
    assert cuda_checkpoint.cuda_devices(tmp_path)[0]["uuid"] == "GPU-1"
    assert len(probes) == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # other GPUs asked for: probed again
    cuda_checkpoint.cached_probe_cuda(tmp_path)
    assert len(probes) == 2


def test_a_probe_that_found_no_gpu_is_not_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(cuda_checkpoint, "probe_cuda", lambda: {"available": False, "devices": []})
    monkeypatch.setattr("coldsnap.host.nvidia_kernel_driver", lambda: "580.159.04")
    assert cuda_checkpoint.cuda_devices(tmp_path) == []
    assert not (tmp_path / cuda_checkpoint.PROBE_CACHE).exists()



def test_criu_keeps_this_boots_kernel_facts_in_the_state_root_and_drops_other_boots(tmp_path, monkeypatch):
    from coldsnap.host import boot_id
    from coldsnap.snapshot.criu_binary import KDAT_DIR_ENV, KDAT_FOLDER, criu_environment

    monkeypatch.setenv("COLDSNAP_STATE_DIR", str(tmp_path / "state"))
    earlier = tmp_path / "state" / KDAT_FOLDER / "an-earlier-boot"
    earlier.mkdir(parents=True)
    (earlier / "criu.kdat").write_bytes(b"facts of another kernel")
    env = criu_environment({"PATH": "/usr/bin"})
    folder = tmp_path / "state" / KDAT_FOLDER / boot_id()
    assert env == {"PATH": "/usr/bin", KDAT_DIR_ENV: str(folder)} and folder.is_dir()
    assert sorted(p.name for p in folder.parent.iterdir()) == [boot_id()]  # (the earlier boot's folder is gone)
    assert criu_environment({KDAT_DIR_ENV: ""}) == {KDAT_DIR_ENV: ""}  # one set (empty: CRIU probes) stays
    folder.chmod(0o777)  # (a folder others can write: its facts are not trusted)
    assert criu_environment({"PATH": "/usr/bin"}) == {"PATH": "/usr/bin"}
    monkeypatch.setenv("COLDSNAP_STATE_DIR", "/proc/no-such-state-root")
    assert criu_environment({"PATH": "/usr/bin"}) == {"PATH": "/usr/bin"}  # no folder: CRIU probes, as stock
