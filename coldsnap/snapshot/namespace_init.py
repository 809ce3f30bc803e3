"""The first process of a restored replica's own pid and mount namespaces.

CRIU restores a tree with the pids it had at capture, so two restores of one image cannot share a pid
namespace. :meth:`coldsnap.snapshot.criu.CriuSnapshotter.restore` therefore runs CRIU as
``unshare --pid --fork --mount-proc -- python -S -c ENTRY ...`` (:data:`ENTRY`); this module, pid 1 there:

1. mounts a private tmpfs on ``/dev/shm`` and copies the image's saved ``/dev/shm`` files into it
   (``--shm=NAME``, one per file), so replicas whose engines use fixed shared-memory names (vLLM's
   semaphores and queues) never meet; with ``--own-images`` (the images directory is this restore's
   copy), renames the sockets whose names encode the pid namespace (the CUDA driver's ``cuda-uvmfd``)
   for this one;
2. replaces itself with ``criu restore`` (no ``-d``), which on success replaces itself with
   :data:`REAPER`: pid 1 for the replica's life, it reports ``ready`` on its standard output (the
   launcher's pipe), reaps orphans, and exits when the restored root does — the kernel then kills
   whatever the tree left, so a replica never outlives its root. (Running ``criu restore -d`` as a
   child instead, this process staying pid 1 and the reaper, saved ~10 ms against this on a trivial tree
   with the reaper importing this module, and nothing against the reaper below, which imports nothing:
   measured on the 2-core CPU machine, not kept.)

Failures print one line to standard error and exit non-zero: CRIU's own status when it ran.

All of this runs before CRIU starts, so the module imports nothing at its top but ``os`` and ``sys`` (with
``-m``, ``json``, ``pathlib`` and the image decoder, spawn → CRIU's start took 32 ms for a GPU tree on the
2-core CPU machine; 12 ms without: ``benchmarks/results/2026-12-07-none-cpu-replica-start/``). The launcher hands over what it
knows already: the ``/dev/shm`` names and, with ``--namespace-sockets=HEX,...``, the names of those sockets
(one per socket), which are then renamed by replacing exactly their bytes in ``files.img``
(:func:`rename_in_place`); only where that is not exact (a name of another length, bytes found elsewhere)
is ``files.img`` decoded here.
"""

from __future__ import annotations

import os
import sys

__all__ = ["ENTRY", "READY", "REAPER", "is_namespace_socket", "namespace_renamed", "namespace_socket_names",
           "rename_in_place"]

ENTRY = "import sys; from coldsnap.snapshot.namespace_init import main; sys.exit(main(sys.argv[1:]))"
"""What ``python -S -c`` runs (``-m`` would import ``runpy`` first: ~3.5 ms)."""

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


def _mount_private_shm(images: str, names: list[str]) -> None:
    import ctypes

    from coldsnap.snapshot.shm import SHM_PATH, restore_shm

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"tmpfs", SHM_PATH.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, b"mode=1777") != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount tmpfs on {SHM_PATH}: {os.strerror(errno)}")
    restore_shm(images, names, SHM_PATH)


# The CUDA driver's own listening socket in every CUDA process (it passes the UVM file descriptor to
# peers, for CUDA IPC): named after the process's pid namespace (its inode) and its pid there, which a
# peer computes to connect. Measured on the H200 (driver 580): ``\0cuda-uvmfd-4026531836-1798\0``.
def is_namespace_socket(name: bytes) -> bool:
    """Whether ``name`` is the CUDA driver's socket name, ``\\0cuda-uvmfd-<inode>-<pid>`` and an optional NUL
    (matched without ``re``: this runs before CRIU starts)."""
    parts = name.split(b"-", 3)
    return (len(parts) == 4 and parts[:2] == [b"\0cuda", b"uvmfd"] and parts[2].isdigit()
            and parts[3].removesuffix(b"\0").isdigit())


def namespace_renamed(name: bytes, pid_namespace_inode: int) -> bytes:
    """``name``, a socket name that encodes its pid namespace (:func:`is_namespace_socket`), for
    ``pid_namespace_inode``."""
    head, kind, _, rest = name.split(b"-", 3)
    return b"-".join((head, kind, b"%d" % pid_namespace_inode, rest))


def namespace_socket_names(names: list[bytes], pid_namespace_inode: int) -> dict[bytes, bytes]:
    """The abstract socket names of ``names`` that encode their pid namespace (the CUDA driver's
    ``cuda-uvmfd``), renamed for ``pid_namespace_inode``: the name the driver would have given them had
    the process started there — what its peers compute — and one no other replica holds."""
    return {name: namespace_renamed(name, pid_namespace_inode) for name in names if is_namespace_socket(name)}


def rename_in_place(files_img: bytes, names: list[bytes], pid_namespace_inode: int) -> bytes | None:
    """``files_img`` with the sockets named ``names`` (one entry per socket) renamed for
    ``pid_namespace_inode`` by replacing their bytes; None where that would not rename exactly those
    sockets' names: a new name of another length (its entry's lengths would change), or an old name's
    bytes found more often than sockets carry it (somewhere else too, or inside another name)."""
    sockets: dict[bytes, int] = {}
    for name in names:
        sockets[name] = sockets.get(name, 0) + 1
    places: list[tuple[int, bytes, bytes]] = []
    for old, count in sockets.items():
        new = namespace_renamed(old, pid_namespace_inode)
        if len(new) != len(old):
            return None
        found = []
        at = files_img.find(old)
        while at >= 0:
            found.append((at, old, new))
            at = files_img.find(old, at + 1)
        if len(found) != count:
            return None
        places += found
    places.sort()
    if any(place[0] + len(place[1]) > following[0] for place, following in zip(places, places[1:])):
        return None
    renamed, end = [], 0
    for at, old, new in places:
        renamed += [files_img[end:at], new]
        end = at + len(old)
    return b"".join([*renamed, files_img[end:]])


def _name_sockets_for_this_namespace(images: str, names: list[bytes] | None) -> None:
    """The image's sockets named after their pid namespace (the CUDA driver's), renamed for this one, in
    ``images/files.img`` — this restore's own copy. ``names``: those sockets' names as the launcher found
    them (None: not given, so decoded here)."""
    if names == []:
        return
    inode = os.stat("/proc/self/ns/pid").st_ino
    path = os.path.join(images, "files.img")
    with open(path, "rb") as image:
        captured = image.read()
    renamed = rename_in_place(captured, names, inode) if names is not None else None
    if renamed is not None:
        with open(f"{path}.coldsnap-tmp", "wb") as image:
            image.write(renamed)
        os.replace(f"{path}.coldsnap-tmp", path)  # (never written through: a link would be the artifact's)
        return
    if b"cuda-uvmfd" not in captured:  # (a CPU tree: nothing to import for)
        return
    from pathlib import Path

    from coldsnap.snapshot.criu_images import read_sockets, rewrite_sockets

    renamed_names = namespace_socket_names([s.name for s in read_sockets(Path(images))[1]], inode)
    if renamed_names:
        rewrite_sockets(Path(images), Path(images), lambda sock: (None, None), renamed_names)


def main(argv: list[str]) -> int:
    # namespace_init [--own-images] [--shm=NAME]... [--namespace-sockets=HEX,...] IMAGES ROOT_PID CRIU [CRIU ARGS...]
    own_images, shm, names = False, [], None
    while argv and argv[0].startswith("--"):
        option, _, value = argv[0].partition("=")
        if option == "--own-images":
            own_images = True
        elif option == "--shm":
            shm.append(value)
        elif option == "--namespace-sockets":
            names = [bytes.fromhex(name) for name in value.split(",") if name]
        else:
            argv = []  # (an option this module does not know: the usage below)
            break
        argv = argv[1:]
    if len(argv) < 3 or os.getpid() != 1:
        sys.stderr.write("usage: unshare --pid --fork --mount-proc python -S -c ENTRY [--own-images] [--shm=NAME]... "
                         "[--namespace-sockets=HEX,...] IMAGES ROOT_PID CRIU [ARGS...]\n")
        return 2
    images, root_pid, criu = argv[0], argv[1], argv[2:]
    try:
        _mount_private_shm(images, shm)
        if own_images:
            _name_sockets_for_this_namespace(images, names)
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
