"""The first process of a restored replica's own pid and mount namespaces.

CRIU restores a tree with the pids it had at capture, so two restores of one image cannot share a pid
namespace. :meth:`coldsnap.snapshot.criu.CriuSnapshotter.restore` therefore runs CRIU as
``unshare --pid --fork --mount-proc -- python -m coldsnap.snapshot.replica_init ...``; this module,
pid 1 there:

1. mounts a private tmpfs on ``/dev/shm`` and copies the image's saved ``/dev/shm`` files into it, so
   replicas whose engines use fixed shared-memory names (vLLM's semaphores and queues) never meet;
   with ``--own-images`` (the images directory is this restore's copy), renames the sockets whose names
   encode the pid namespace (the CUDA driver's ``cuda-uvmfd``) for this one;
2. replaces itself with ``criu restore`` (no ``-d``), which on success replaces itself with
   :data:`REAPER`: pid 1 for the replica's life, it reports ``ready`` on its standard output (the
   launcher's pipe), reaps orphans, and exits when the restored root does — the kernel then kills
   whatever the tree left, so a replica never outlives its root.

Failures print one line to standard error and exit non-zero: CRIU's own status when it ran.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from pathlib import Path

__all__ = ["READY", "REAPER"]

READY = b"coldsnap-replica-ready\n"

# Run as ``python -S -c REAPER ROOT_PID`` by CRIU's --exec-cmd once the tree is restored: nothing to
# import, so it is up within milliseconds of CRIU finishing.
REAPER = """\
import os, sys
root = int(sys.argv[1])
os.write(1, b"coldsnap-replica-ready\\n")
null = os.open("/dev/null", os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
while True:
    try:
        pid, _ = os.wait()
    except ChildProcessError:
        break
    if pid == root:
        break
"""

_MS_NOSUID, _MS_NODEV = 2, 4


def _mount_private_shm(images: Path) -> None:
    from coldsnap.snapshot.shm import SHM_DIR, restore_shm

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"tmpfs", str(SHM_DIR).encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, b"mode=1777") != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount tmpfs on {SHM_DIR}: {os.strerror(errno)}")
    # (process_tree.TreeFiles' file, read without importing process_tree: this runs on the restore's path)
    names = json.loads((images / "coldsnap-tree-files.json").read_text()).get("shm", [])
    restore_shm(images, names, SHM_DIR)


def _name_sockets_for_this_namespace(images: Path) -> None:
    """The image's sockets named after their pid namespace (the CUDA driver's), renamed for this one, in
    ``images/files.img`` — this restore's own copy."""
    if b"cuda-uvmfd" not in (images / "files.img").read_bytes():  # (a CPU tree: nothing to import for)
        return
    from coldsnap.snapshot.criu_images import read_sockets, rewrite_sockets
    from coldsnap.snapshot.replica import namespace_socket_names

    renamed = namespace_socket_names([s.name for s in read_sockets(images)[1]], os.stat("/proc/self/ns/pid").st_ino)
    if renamed:
        rewrite_sockets(images, images, lambda sock: (None, None), renamed)


def main(argv: list[str]) -> int:
    # replica_init [--own-images] IMAGES ROOT_PID CRIU [CRIU ARGS...]
    own_images = bool(argv) and argv[0] == "--own-images"
    argv = argv[1:] if own_images else argv
    if len(argv) < 3 or os.getpid() != 1:
        sys.stderr.write("usage: unshare --pid --fork --mount-proc python -m coldsnap.snapshot.replica_init "
                         "[--own-images] IMAGES ROOT_PID CRIU [ARGS...]\n")
        return 2
    images, root_pid, criu = Path(argv[0]), argv[1], argv[2:]
    try:
        _mount_private_shm(images)
        if own_images:
            _name_sockets_for_this_namespace(images)
    except Exception as exc:  # (pid 1 of a namespace: a traceback here would be lost with it)
        sys.stderr.write(f"coldsnap replica: {exc}\n")
        return 1
    command = [*criu, "--exec-cmd", "--", sys.executable, "-S", "-c", REAPER, root_pid]
    try:
        os.execv(command[0], command)
    except OSError as exc:
        sys.stderr.write(f"coldsnap replica: cannot run {command[0]}: {exc}\n")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
