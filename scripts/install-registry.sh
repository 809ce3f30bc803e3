#!/usr/bin/env bash
# Install what the registry tests and benchmarks run against: Debian's docker-registry (distribution
# 2.8, a real OCI registry server, run on localhost by tests/registry_server.py), htpasswd (its basic-auth
# file, bcrypt) and openssl (its TLS certificate). coldsnap itself needs none of them: `coldsnap publish`
# and `pull` speak the distribution API to any registry.
#
#   bash scripts/install-registry.sh      (root; apt; idempotent: a second run only checks)
#
# The Debian package's own service is not started (no systemd here; tests start their own).
set -euo pipefail
log() { printf 'install-registry: %s\n' "$*" >&2; }
if command -v docker-registry >/dev/null && command -v htpasswd >/dev/null && command -v openssl >/dev/null; then
    log "docker-registry, htpasswd and openssl already installed"
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    log "not root: skipping (run 'sudo bash scripts/install-registry.sh'; the registry tests skip themselves without it)"
    exit 0
fi
command -v apt-get >/dev/null || { log "no apt-get: install docker-registry (distribution 2.8), htpasswd and openssl yourself"; exit 1; }
log "installing docker-registry, apache2-utils (htpasswd) and openssl with apt"
bash "$(dirname "${BASH_SOURCE[0]}")/apt-install-quiet.sh" docker-registry apache2-utils openssl
log "installed: $(docker-registry --version)"
