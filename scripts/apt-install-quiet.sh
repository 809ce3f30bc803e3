#!/usr/bin/env bash
# apt-install-quiet.sh - install Debian packages without starting their services (there is no systemd here;
# the tests start their own servers). Used by scripts/install-registry.sh and scripts/install-sshd.sh.
#
#   bash scripts/apt-install-quiet.sh PACKAGE...     (root)
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
apt-get -q update >/dev/null 2>&1 || apt-get -q update >&2
# policy-rc.d: a package's postinst must not try to start its service
printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d.coldsnap
had_policy=0; [ -e /usr/sbin/policy-rc.d ] && had_policy=1
[ "$had_policy" = 1 ] || { cp /usr/sbin/policy-rc.d.coldsnap /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; }
trap '[ "$had_policy" = 1 ] || rm -f /usr/sbin/policy-rc.d; rm -f /usr/sbin/policy-rc.d.coldsnap' EXIT
apt-get -q install -y --no-install-recommends "$@" >&2
