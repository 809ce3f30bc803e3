"""Run a command where ``io_uring_setup`` fails with ENOSYS, so the process tree can be dumped by CRIU.

CRIU cannot dump io_uring instances, and uvloop (vLLM's API server) opens one whatever
``UV_USE_IO_URING`` says. A seccomp filter that makes ``io_uring_setup`` return ENOSYS makes libuv fall
back to epoll; the filter is inherited by every child and restored by CRIU with the process.

    python -m coldsnap.snapshot.no_io_uring -- COMMAND [ARGS...]
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
import sys

__all__ = ["install_filter", "main", "IO_URING_SETUP"]

IO_URING_SETUP = 425  # the same number on every architecture (the unified syscall table, Linux 5.1+)

_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_BPF_LD_W_ABS = 0x20
_BPF_JEQ_K = 0x15
_BPF_RET_K = 0x06
_SECCOMP_RET_ALLOW = 0x7FFF0000
_SECCOMP_RET_ERRNO = 0x00050000


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install_filter() -> None:
    """Install the filter on this process (and so on everything it execs or forks afterwards)."""
    arch = _AUDIT_ARCH.get(platform.machine())
    if arch is None:
        raise OSError(errno.ENOTSUP, f"no seccomp architecture constant for {platform.machine()}")
    program = [
        (_BPF_LD_W_ABS, 0, 0, 4),  # seccomp_data.arch
        (_BPF_JEQ_K, 0, 3, arch),  # another ABI: allow
        (_BPF_LD_W_ABS, 0, 0, 0),  # seccomp_data.nr
        (_BPF_JEQ_K, 0, 1, IO_URING_SETUP),
        (_BPF_RET_K, 0, 0, _SECCOMP_RET_ERRNO | errno.ENOSYS),
        (_BPF_RET_K, 0, 0, _SECCOMP_RET_ALLOW),
    ]
    raw = b"".join(struct.pack("=HBBI", *insn) for insn in program)
    buffer = ctypes.create_string_buffer(raw, len(raw))
    fprog = _SockFprog(len(program), ctypes.cast(buffer, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    prctl = libc.prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    if prctl(_PR_SET_NO_NEW_PRIVS, 1, None, 0, 0) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(code)}")
    if prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"prctl(PR_SET_SECCOMP): {os.strerror(code)}")


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    if not args or args[0] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr)
        return 0 if args else 2
    try:
        install_filter()
        os.execvp(args[0], args)
    except OSError as exc:
        print(f"coldsnap no_io_uring: {args[0]}: {exc.strerror or exc}", file=sys.stderr)
        return 127 if exc.errno == errno.ENOENT else 126
    return 0  # not reached: exec replaced the process


if __name__ == "__main__":
    sys.exit(main())
