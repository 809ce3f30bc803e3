"""A TCP echo pair for tests/integration/test_unit_connections.py, run on a simulated host:

    echo_pair_workload.py dump server|client ADDRESS PORT LOG IMAGES SECONDS
        starts the server (or the client of the server at ADDRESS) as a child, lets it run, CRIU-dumps it
    echo_pair_workload.py restore IMAGES STATE MAP_JSON BARRIER_DIR [abort]
        restores it with the captured → new addresses of MAP_JSON, CRIU held at post-restore until both
        restores reached BARRIER_DIR (or, with ``abort``, failing there)

The client sends a counter every 0.2 s and logs each echo; a reset ends it with "client: <error>"."""

import ipaddress
import json
import socket
import subprocess
import sys
import time
from pathlib import Path


def serve(address: str, port: int, log) -> None:
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((address, port))
    listener.listen(1)
    connection, _ = listener.accept()
    while data := connection.recv(100):
        connection.sendall(data)
    log.write("server: eof\n")


def talk(address: str, port: int, log) -> None:
    connection = socket.create_connection((address, port))
    count = 0
    try:
        while True:
            count += 1
            connection.sendall(f"{count}\n".encode())
            log.write(f"echo {connection.recv(100).decode().strip()}\n")
            time.sleep(0.2)
    except OSError as exc:
        log.write(f"client: {exc}\n")


def main(argv: list[str]) -> None:
    from coldsnap.snapshot.criu import CriuSnapshotter
    from coldsnap.snapshot.criu_options import SnapshotOptions

    snapshotter = CriuSnapshotter(options=SnapshotOptions(tcp="established", network_lock="nftables"))
    if argv[0] in ("server", "client"):
        with open(argv[3], "a", buffering=1) as log:
            (serve if argv[0] == "server" else talk)(argv[1], int(argv[2]), log)
    elif argv[0] == "dump":
        role, address, port, log, images, seconds = argv[1:7]
        child = subprocess.Popen([sys.executable, __file__, role, address, port, log], stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        time.sleep(float(seconds))
        snapshotter.dump(child.pid, Path(images), compact=False)
    else:
        from coldsnap.snapshot.moved_sockets import PortGeneration, replica_images

        images, state, mapping, barrier_dir = Path(argv[1]), Path(argv[2]), json.loads(argv[3]), Path(argv[4])
        aborting = argv[5:] == ["abort"]
        moved = {ipaddress.ip_address(k).packed: ipaddress.ip_address(v).packed for k, v in mapping.items()}
        own = replica_images(images, state / "images", PortGeneration(0), {}, b"", moved)

        def both_restored() -> None:
            (barrier_dir / state.name).touch()
            if aborting:
                raise RuntimeError("the other unit failed")
            while len(list(barrier_dir.iterdir())) < 2:
                time.sleep(0.01)

        try:
            restored = snapshotter.restore(own, state, own_images=True, before_unlock=both_restored)
        except RuntimeError as exc:
            print(f"aborted: {exc}", flush=True)
            sys.exit(3)
        print(f"restored {restored.pid}", flush=True)
        time.sleep(3)  # (the replica lives as long as its reaper; the test reads the log meanwhile)


if __name__ == "__main__":
    main(sys.argv[1:])
