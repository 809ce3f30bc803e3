"""A tree captured on one simulated host (tests/simulated_hosts.py) and restored on another, with real CRIU:
the network namespace is placement, not identity. The dump takes the tree's namespace as external
(``--external net[...]``), the restore puts it into the restoring process's namespace, and the per-restore
socket image maps the captured host's address onto the new one (``replica_images(addresses=...)``)."""

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from coldsnap.snapshot.criu import CriuSnapshotter
from coldsnap.snapshot.criu_options import SnapshotOptions
from coldsnap.snapshot.process_tree import kill_tree
from coldsnap.snapshot.moved_sockets import PortGeneration, replica_images
from tests.simulated_hosts import simulated_hosts

pytestmark = [
    pytest.mark.criu,
    pytest.mark.skipif(os.geteuid() != 0, reason="CRIU and network namespaces need root"),
    pytest.mark.skipif(shutil.which("ip") is None or shutil.which("nsenter") is None, reason="no iproute2 / nsenter"),
]
REPO = Path(__file__).resolve().parents[2]
BOUND, ANY = 18556, 18557

SERVER = """
import select, socket, sys
bound = socket.create_server((sys.argv[1], %d))  # bound to this host's address
anywhere = socket.create_server(("0.0.0.0", %d))
print("listening", flush=True)
served = 0
while True:
    for listener in select.select([bound, anywhere], [], [])[0]:
        connection, _ = listener.accept()
        served += 1
        connection.sendall(b"answer %%d" %% served)
        connection.close()
""" % (BOUND, ANY)

ASK = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10) as connection:
    print(connection.recv(100).decode())
"""


def _ask(host, address: str, port: int) -> subprocess.CompletedProcess:
    return subprocess.run(["nsenter", f"--net=/var/run/netns/{host.namespace}", sys.executable, "-c", ASK, address,
                           str(port)], capture_output=True, text=True, timeout=60)


def test_a_tree_captured_on_one_host_serves_on_another_at_that_hosts_address(tmp_path):
    with simulated_hosts(3) as (a, b, client):
        server = subprocess.Popen(["nsenter", f"--net=/var/run/netns/{a.namespace}", sys.executable, "-c", SERVER,
                                   a.address], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                                  start_new_session=True)
        restored = None
        try:
            assert server.stdout.readline() == "listening\n"
            assert _ask(client, a.address, BOUND).stdout.strip() == "answer 1"
            images = tmp_path / "images"
            snapshotter = CriuSnapshotter(options=SnapshotOptions(tcp="none"))
            snapshotter.dump(server.pid, images)  # (nsenter exec'd python: the server is the tree's root)
            server.wait(timeout=30)
            assert (images / "coldsnap-tree-files.json").read_text().count('"external_netns": true') == 1

            # unit B's per-restore socket image: host A's address becomes host B's
            placed = replica_images(images, tmp_path / "placed", PortGeneration(shift=0), {},
                                    addresses={socket.inet_aton(a.address): socket.inet_aton(b.address)})
            restore = ("from pathlib import Path; from coldsnap.snapshot.criu import CriuSnapshotter\n"
                       "from coldsnap.snapshot.criu_options import SnapshotOptions\n"
                       "result = CriuSnapshotter(options=SnapshotOptions(tcp='none')).restore("
                       f"Path({str(placed)!r}), Path({str(tmp_path / 'state')!r}), own_images=True)\n"
                       "print(result.pid)")
            done = subprocess.run(["nsenter", f"--net=/var/run/netns/{b.namespace}", sys.executable, "-c", restore],
                                  capture_output=True, text=True, timeout=120,
                                  env={**os.environ, "PYTHONPATH": str(REPO)})
            assert done.returncode == 0, done.stderr[-3000:]
            restored = int(done.stdout.split()[-1])

            # the same process (its counter goes on), now at host B's address, on both listeners
            assert _ask(client, b.address, BOUND).stdout.strip() == "answer 2"
            assert _ask(client, b.address, ANY).stdout.strip() == "answer 3"
            assert _ask(client, a.address, BOUND).returncode != 0  # nothing serves on host A any more
        finally:
            if restored is not None:
                kill_tree(restored)
            if server.poll() is None:
                server.kill()
            server.wait()
