"""A real OCI registry on localhost for tests and benchmarks: Debian's ``docker-registry`` (distribution 2.8),
with TLS (a CA made here) and basic auth (htpasswd, bcrypt), storage in a folder that goes with it.

    with local_registry(folder) as registry:     # registry.address = "127.0.0.1:PORT"
        env = registry.client_env()               # SSL_CERT_FILE + REGISTRY_AUTH_FILE for coldsnap

Installed by ``scripts/setup.sh`` (``scripts/install-registry.sh``); :func:`missing_tools` says what is not.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator
from tests.helpers import free_port

__all__ = ["LocalRegistry", "local_registry", "missing_tools"]

USER, PASSWORD = "coldsnap", "not-a-real-secret-4711"
TOOLS = ("docker-registry", "htpasswd", "openssl")


def missing_tools() -> list[str]:
    return [tool for tool in TOOLS if shutil.which(tool) is None]



@dataclass
class LocalRegistry:
    address: str
    folder: Path
    tls: bool
    auth: bool

    @property
    def ca_file(self) -> Path:
        return self.folder / "ca.crt"

    @property
    def auth_file(self) -> Path:
        return self.folder / "auth.json"

    @property
    def storage(self) -> Path:
        return self.folder / "storage"

    def client_env(self) -> dict[str, str]:
        """What a coldsnap process needs to reach this registry: its CA and the auth file."""
        env = {"REGISTRY_AUTH_FILE": str(self.auth_file)}
        if self.tls:
            env["SSL_CERT_FILE"] = str(self.ca_file)
        else:
            env["COLDSNAP_PLAIN_HTTP_REGISTRIES"] = self.address
        return env


def _run(*command: str, cwd: Path) -> None:
    subprocess.run(command, cwd=cwd, check=True, capture_output=True)


def _make_tls(folder: Path) -> None:
    _run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=coldsnap test CA",
         "-keyout", "ca.key", "-out", "ca.crt", "-addext", "basicConstraints=critical,CA:TRUE",
         "-addext", "keyUsage=critical,keyCertSign", cwd=folder)
    _run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", "server.key",
         "-out", "server.csr", cwd=folder)
    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    _run("openssl", "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
         "-days", "2", "-out", "server.crt", "-extfile", "san.ext", cwd=folder)


@contextlib.contextmanager
def local_registry(folder: Path, tls: bool = True, auth: bool = True) -> Iterator[LocalRegistry]:
    """Start a registry serving from ``folder`` (created; removed with everything in it at the end)."""
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    registry = LocalRegistry(f"127.0.0.1:{port}", folder, tls, auth)
    config = {"version": 0.1, "log": {"level": "error", "accesslog": {"disabled": True}},
              "storage": {"filesystem": {"rootdirectory": str(registry.storage)}, "delete": {"enabled": True}},
              "http": {"addr": registry.address, "secret": "coldsnap-test"}}
    if tls:
        _make_tls(folder)
        config["http"]["tls"] = {"certificate": str(folder / "server.crt"), "key": str(folder / "server.key")}
    if auth:
        _run("htpasswd", "-Bbc", "htpasswd", USER, PASSWORD, cwd=folder)
        config["auth"] = {"htpasswd": {"realm": "coldsnap-test", "path": str(folder / "htpasswd")}}
    registry.auth_file.write_text(json.dumps(
        {"auths": {registry.address: {"auth": base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()}}}))
    (folder / "config.yml").write_text(json.dumps(config))  # YAML is a superset of JSON
    log = open(folder / "registry.log", "wb")
    # the registry reads REGISTRY_* variables as configuration (REGISTRY_AUTH_FILE of a client would be its `auth`)
    env = {k: v for k, v in os.environ.items() if not k.startswith("REGISTRY_")}
    server = subprocess.Popen(["docker-registry", "serve", str(folder / "config.yml")], stdout=log, stderr=log,
                              start_new_session=True, env=env)
    try:
        _wait_ready(registry, server)
        yield registry
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        log.close()
        shutil.rmtree(folder, ignore_errors=True)


def _wait_ready(registry: LocalRegistry, server: subprocess.Popen) -> None:
    import ssl

    context = ssl.create_default_context(cafile=str(registry.ca_file)) if registry.tls else None
    url = f"{'https' if registry.tls else 'http'}://{registry.address}/v2/"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(url, timeout=2, context=context).read()
            return
        except urllib.error.HTTPError as exc:
            if exc.code == 401:  # up, and asking for the login
                return
        except OSError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"docker-registry did not start: {(registry.folder / 'registry.log').read_text()[-2000:]}")
        time.sleep(0.1)
