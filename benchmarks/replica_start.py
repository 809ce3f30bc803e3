"""A replica restore's first process: from the launcher's spawn to CRIU's start.

    sudo python -m benchmarks.replica_start --artifact DIR [--cuda-sockets N] [--repeat 25] [--out F]

Every restore of a replica runs ``unshare --pid --fork --mount-proc`` and, as pid 1 of the new namespaces,
:mod:`coldsnap.snapshot.namespace_init`: it mounts the replica's ``/dev/shm``, puts the image's saved
``/dev/shm`` files back, renames the sockets named after their pid namespace (the CUDA driver's) in its own
``files.img``, then replaces itself with CRIU. All of that is on the restore's path before CRIU starts.
Timed here, each run a new process from spawn to exit, with ``/bin/true`` standing in for CRIU (so a run
ends where CRIU would begin), ``--repeat`` times interleaved, medians reported:

  floor             ``unshare ... python -S -c pass``: the namespaces and an interpreter, nothing else
  namespace_init      what a restore runs: the launcher's options (``/dev/shm`` names, the sockets to rename)
  namespace_init, decoding files.img   the same without the sockets' names: ``files.img`` decoded there
                                     (what every GPU restore did before, and what it still does where
                                     replacing the names' bytes would not be exact)

``--artifact``: a captured artifact (unit-0's images are linked into a scratch directory, the artifact is
only read). ``--cuda-sockets N`` adds N unix sockets named as the CUDA driver names them to the scratch
copy's ``files.img``: a CPU capture has none, a GPU capture's engine has some, and only they make
namespace_init rename anything. Needs root (the namespaces, the tmpfs). Writes ``--out`` (JSON) and prints
a table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import check_artifact, finish

from coldsnap.snapshot.criu_images import FILES_IMAGE, _encode
from coldsnap.snapshot.process_tree import STATE_FILE, TreeFiles
from coldsnap.snapshot.moved_sockets import namespace_sockets
from coldsnap.snapshot.namespace_init import ENTRY

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[1])
_VARINT, _LENGTH = 0, 2


def _cuda_socket_entry(ino: int, pid: int) -> bytes:
    """A files.img entry (length-prefixed FileEntry) of an abstract unix socket named as the CUDA driver
    names it in the host's initial pid namespace."""
    name = b"\0cuda-uvmfd-4026531836-%d\0" % pid
    unix = _encode([(1, _VARINT, ino), (2, _VARINT, ino), (3, _VARINT, 1), (4, _VARINT, 10), (11, _LENGTH, name)])
    entry = _encode([(1, _VARINT, 5), (2, _VARINT, ino), (16, _LENGTH, unix)])
    return struct.pack("<I", len(entry)) + entry


def scratch_images(artifact: Path, scratch: Path, cuda_sockets: int) -> Path:
    """Unit-0's images as a restore's replica has them: a link to every entry (``devshm`` too, whose sparse
    files a copy would fill) and a ``files.img`` of its own, with ``cuda_sockets`` driver sockets added."""
    source = artifact / "units" / "unit-0" / "images"
    if not (source / STATE_FILE).is_file():
        raise SystemExit(f"{source} holds no {STATE_FILE}: not a captured artifact's images")
    images = scratch / "images"
    images.mkdir()
    for entry in source.iterdir():
        if entry.name == FILES_IMAGE:
            data = entry.read_bytes() + b"".join(_cuda_socket_entry(1 << 30 | n, 1000 + n) for n in range(cuda_sockets))
            (images / FILES_IMAGE).write_bytes(data)
        else:
            os.symlink(entry.resolve(), images / entry.name)
    return images


def commands(images: Path) -> dict[str, list[str]]:
    unshare = shutil.which("unshare") or "unshare"
    namespaces = [unshare, "--pid", "--fork", "--mount-proc", "--", sys.executable, "-S", "-c"]
    shm = [f"--shm={name}" for name in TreeFiles.load(images).shm]
    names = namespace_sockets(images)
    tail = [str(images), "1", "/bin/true"]
    return {
        "floor": [*namespaces, "pass"],
        "namespace_init": [*namespaces, ENTRY, *shm, "--own-images",
                         f"--namespace-sockets={','.join(n.hex() for n in names or [])}", *tail],
        "namespace_init, decoding files.img": [*namespaces, ENTRY, *shm, "--own-images", *tail],
    }


def measure(artifact: Path, cuda_sockets: int, repeat: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (_PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p)}
    with tempfile.TemporaryDirectory(prefix="coldsnap-replica-start-") as scratch:
        images = scratch_images(artifact, Path(scratch), cuda_sockets)
        files_img = (images / FILES_IMAGE).read_bytes()
        argvs = commands(images)  # (from the captured files.img, before any run renamed its sockets)
        runs: dict[str, list[float]] = {label: [] for label in argvs}
        for index in range(repeat + 1):  # the first round unmeasured: byte-compiled files written, caches warm
            for label, argv in argvs.items():
                (images / FILES_IMAGE).write_bytes(files_img)  # (each run renames the captured names)
                started = time.perf_counter()
                done = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                seconds = time.perf_counter() - started
                if done.returncode != 0:
                    raise SystemExit(f"{label} exited {done.returncode}: {done.stderr.decode()[-800:]}")
                if index:
                    runs[label].append(round(seconds, 5))
                if cuda_sockets and label != "floor" and (images / FILES_IMAGE).read_bytes() == files_img:
                    raise SystemExit(f"{label}: the CUDA driver's sockets were not renamed")
        shm = len(TreeFiles.load(images).shm)
    return {"benchmark": "replica_start", "artifact": str(artifact), "python": sys.executable, "repeat": repeat,
            "cuda_sockets": cuda_sockets, "files_img_bytes": len(files_img), "shm_files": shm, "runs_s": runs,
            "median_s": {label: round(statistics.median(values), 5) for label, values in runs.items()}}


def table(result: dict) -> str:
    lines = [f"replica start, spawn → CRIU's start ({result['repeat']} runs each, median; files.img "
             f"{result['files_img_bytes']} bytes, {result['cuda_sockets']} CUDA driver sockets, "
             f"{result['shm_files']} /dev/shm files)"]
    for label, seconds in result["median_s"].items():
        lines.append(f"  {label:34s} {seconds * 1000:7.1f} ms")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", type=Path, required=True, help="a captured artifact directory (only read)")
    parser.add_argument("--cuda-sockets", type=int, default=0,
                        help="CUDA driver sockets added to the copy's files.img (default 0)")
    parser.add_argument("--repeat", type=int, default=25, help="runs of each command (default 25)")
    parser.add_argument("--out", type=Path, help="write the JSON result here")
    args = parser.parse_args()
    check_artifact(parser, args.artifact)
    if args.repeat < 1 or args.cuda_sockets < 0:
        parser.error("--repeat must be at least 1 and --cuda-sockets not negative")
    if os.geteuid() != 0:
        parser.error("needs root: the replica's namespaces and its /dev/shm mount")
    result = measure(args.artifact, args.cuda_sockets, args.repeat)
    return finish(result, args.out, table(result))


if __name__ == "__main__":
    sys.exit(main())
