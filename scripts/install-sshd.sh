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
bash "$(dirname "${BASH_SOURCE[0]}")/apt-install-quiet.sh" openssh-server openssh-client
log "installed: $(/usr/sbin/sshd -V 2>&1 | head -1 || true)"
