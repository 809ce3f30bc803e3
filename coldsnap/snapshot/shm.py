"""The /dev/shm files of a process tree, saved with its CRIU images and put back before each restore.

Imports nothing but ``os``: :mod:`coldsnap.snapshot.namespace_init` runs it as pid 1 of a replica's
namespaces, before CRIU starts, where every millisecond of imports is on the restore's path (``pathlib``
and ``shutil`` alone cost ~9 ms of a ``python -S`` start on the 2-core CPU machine). Paths are ``str`` or
any ``os.PathLike``.
"""

from __future__ import annotations

import os

__all__ = ["SHM_PATH", "SPARSE_BLOCK", "copy_sparse", "restore_shm"]

SHM_PATH = "/dev/shm"
SPARSE_BLOCK = 1 << 20
_ZEROS = bytes(SPARSE_BLOCK)


def copy_sparse(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> int:
    """Copy ``source`` to ``target`` (same size and mode) writing only its non-zero 1 MiB blocks; the
    rest stays a hole. vLLM's shared-memory queues are 400 MB files that hold ~20 MB of data: copying
    them whole cost every capture and every restore hundreds of MB of writes. Returns bytes written."""
    written = 0
    with open(source, "rb") as src, open(target, "wb") as dst:
        size = os.fstat(src.fileno()).st_size
        dst.truncate(size)
        offset = 0
        while offset < size:
            try:  # skip holes the source already has (tmpfs and most file systems report them)
                offset = os.lseek(src.fileno(), offset, os.SEEK_DATA)
            except OSError:  # ENXIO: nothing but a hole up to the end
                break
            end = min(size, os.lseek(src.fileno(), offset, os.SEEK_HOLE))
            src.seek(offset)
            while offset < end:
                block = src.read(min(SPARSE_BLOCK - offset % SPARSE_BLOCK, end - offset))
                if not block:
                    break
                if block != _ZEROS[:len(block)]:
                    dst.seek(offset)
                    dst.write(block)
                    written += len(block)
                offset += len(block)
        os.fchmod(dst.fileno(), os.fstat(src.fileno()).st_mode & 0o7777)  # (shutil.copymode's bits)
    return written


def restore_shm(images: str | os.PathLike[str], names: list[str], shm_dir: str | os.PathLike[str]) -> None:
    """The image's saved /dev/shm files, put back in ``shm_dir``. Always the captured bytes: a previous
    incarnation killed mid-flight leaves its /dev/shm files behind with *its* state (vLLM's shared-memory
    message queues advanced past the captured position), and a restored tree mapping them desynchronizes.
    Replaced by rename, so a process still holding an old file keeps its own inode."""
    for name in names:
        tmp = os.path.join(shm_dir, f".{name}.coldsnap-tmp")
        copy_sparse(os.path.join(images, "devshm", name), tmp)
        os.replace(tmp, os.path.join(shm_dir, name))
