"""The seccomp launcher: io_uring_setup fails with ENOSYS in the command and its children, nothing else changes."""

import errno
import subprocess
import sys

PROBE = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
def probe():
    rc = libc.syscall(425, 8, None)  # io_uring_setup(8 entries, params=NULL)
    return rc, ctypes.get_errno()
pid = os.fork()
if pid == 0:
    rc, err = probe()
    os._exit(0 if (rc, err) == (-1, 38) else 1)
_, status = os.waitpid(pid, 0)
rc, err = probe()
print(rc, err, os.waitstatus_to_exitcode(status), os.getpid() > 0)
"""


def test_io_uring_setup_gets_enosys_in_command_and_children():
    result = subprocess.run(
        [sys.executable, "-m", "coldsnap.snapshot.no_io_uring", "--", sys.executable, "-c", PROBE],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["-1", str(errno.ENOSYS), "0", "True"]


def test_without_the_filter_the_syscall_exists():
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60)
    rc, err = result.stdout.split()[:2]
    assert (rc, err) != ("-1", str(errno.ENOSYS))  # EFAULT for the NULL params, or a ring: the kernel has it


def test_missing_command_and_usage():
    missing = subprocess.run([sys.executable, "-m", "coldsnap.snapshot.no_io_uring", "--", "/nonexistent/cmd"],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 127 and "No such file" in missing.stderr and "Traceback" not in missing.stderr
    usage = subprocess.run([sys.executable, "-m", "coldsnap.snapshot.no_io_uring"], capture_output=True, text=True)
    assert usage.returncode == 2 and "io_uring" in usage.stderr
