#!/usr/bin/env bash
# Install what the host provider's ssh-transport test runs against: Debian's openssh-server (the test starts
# its own sshd on a simulated host's address, with a host key and a client key it makes; tests/integration/
# test_host_provider.py). coldsnap itself needs no sshd: `coldsnap provider serve` uses OpenSSH's client.
#
#   bash scripts/install-sshd.sh      (root; apt; idempotent: a second run only checks)
#
# The package's own service is not started (no systemd here; the test starts its own).
set -euo pipefail
log() { printf 'install-sshd: %s\n' "$*" >&2; }
if [ -x /usr/sbin/sshd ] && command -v ssh >/dev/null && command -v ssh-keygen >/dev/null; then
    log "sshd, ssh and ssh-keygen already installed"
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    log "not root: skipping (run 'sudo bash scripts/install-sshd.sh'; the ssh-transport test skips itself without it)"
    exit 0
fi
command -v apt-get >/dev/null || { log "no apt-get: install OpenSSH's server and client yourself"; exit 1; }
log "installing openssh-server and openssh-client with apt"
export DEBIAN_FRONTEND=noninteractive
apt-get -q update >/dev/null 2>&1 || apt-get -q update >&2
# policy-rc.d: the package's postinst must not try to start its service
printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d.coldsnap
had_policy=0; [ -e /usr/sbin/policy-rc.d ] && had_policy=1
[ "$had_policy" = 1 ] || { cp /usr/sbin/policy-rc.d.coldsnap /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; }
trap '[ "$had_policy" = 1 ] || rm -f /usr/sbin/policy-rc.d; rm -f /usr/sbin/policy-rc.d.coldsnap' EXIT
apt-get -q install -y --no-install-recommends openssh-server openssh-client >&2
log "installed: $(/usr/sbin/sshd -V 2>&1 | head -1 || true)"
