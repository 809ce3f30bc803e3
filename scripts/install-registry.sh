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
export DEBIAN_FRONTEND=noninteractive
apt-get -q update >/dev/null 2>&1 || apt-get -q update >&2
# policy-rc.d: the package's postinst must not try to start its service
printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d.coldsnap
had_policy=0; [ -e /usr/sbin/policy-rc.d ] && had_policy=1
[ "$had_policy" = 1 ] || { cp /usr/sbin/policy-rc.d.coldsnap /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; }
trap '[ "$had_policy" = 1 ] || rm -f /usr/sbin/policy-rc.d; rm -f /usr/sbin/policy-rc.d.coldsnap' EXIT
apt-get -q install -y --no-install-recommends docker-registry apache2-utils openssl >&2
log "installed: $(docker-registry --version)"
