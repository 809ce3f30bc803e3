#!/usr/bin/env bash
# install-containers.sh - install what building and running coldsnap's images needs on a Debian host,
# with no daemon and no registry: buildah (build), podman (run), runc (the OCI runtime that works
# here), debootstrap (the base image is made from Debian's archive), and the configuration podman
# needs on these machines.
#
#   bash scripts/install-containers.sh          install (idempotent: a second run only checks)
#   bash scripts/install-containers.sh --print-env
#                                               print the environment the other scripts set
#                                               (CONTAINERS_CONF, CONTAINERS_STORAGE_CONF), for eval
#
# Needs root (apt-get). The configuration goes to /opt/coldsnap/containers (coldsnap's, not /etc):
#   containers.conf  [containers] default_ulimits = [] (podman's default rlimits fail here),
#                    [engine] cgroup_manager = "cgroupfs" (no systemd), runtime = "runc" (crun fails
#                    on these hosts' hybrid cgroups)
#   storage.conf     driver vfs (no overlay or fuse-overlayfs needed), graph root
#                    /var/lib/coldsnap/containers/storage (delete it to drop every image)
# Both are used through CONTAINERS_CONF / CONTAINERS_STORAGE_CONF, so the host's own podman set-up, if
# any, is untouched. See docs/images.md.
set -euo pipefail

PROG=install-containers
CONF_DIR=${COLDSNAP_CONTAINERS_CONF_DIR:-/opt/coldsnap/containers}
STORAGE_ROOT=${COLDSNAP_CONTAINERS_ROOT:-/var/lib/coldsnap/containers/storage}
RUN_ROOT=${COLDSNAP_CONTAINERS_RUNROOT:-/run/coldsnap/containers}
PACKAGES=(buildah podman runc debootstrap)

log() { printf '%s: %s\n' "$PROG" "$*" >&2; }
die() { printf '%s: ERROR: %s\n' "$PROG" "$*" >&2; exit 1; }

print_env() {
    printf 'export CONTAINERS_CONF=%q\n' "$CONF_DIR/containers.conf"
    printf 'export CONTAINERS_STORAGE_CONF=%q\n' "$CONF_DIR/storage.conf"
}

case "${1:-}" in
    -h|--help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --print-env) print_env; exit 0 ;;
    "") ;;
    *) printf '%s: unknown argument %s (see --help)\n' "$PROG" "$1" >&2; exit 2 ;;
esac

[ "$(id -u)" = 0 ] || die "needs root (apt-get install ${PACKAGES[*]}); run: sudo bash $0"
command -v apt-get >/dev/null 2>&1 || die "needs apt-get (a Debian or Ubuntu host)"

missing=()
for package in "${PACKAGES[@]}"; do
    [ "$(dpkg-query -W -f '${Status}' "$package" 2>/dev/null)" = "install ok installed" ] || missing+=("$package")
done
if [ ${#missing[@]} -eq 0 ]; then
    log "${PACKAGES[*]} already installed"
else
    log "installing ${missing[*]} (apt-get, no recommends)"
    # --no-install-recommends: podman's recommends (slirp4netns, fuse-overlayfs, catatonit) serve rootless
    # and overlay set-ups; rootful vfs needs none of them.
    apt-get -q update >&2 || die "apt-get update failed (network? see above)"
    DEBIAN_FRONTEND=noninteractive apt-get -q install -y --no-install-recommends "${missing[@]}" >&2 \
        || die "apt-get install ${missing[*]} failed (see above)"
fi

# The configuration, rewritten only when it differs (so a second run changes nothing).
write_if_changed() {
    local path=$1 text=$2
    if [ "$(cat "$path" 2>/dev/null)" != "$text" ]; then
        mkdir -p -- "$(dirname -- "$path")"
        printf '%s\n' "$text" >"$path.tmp.$$" && mv -f -- "$path.tmp.$$" "$path"
        log "wrote $path"
    fi
}
write_if_changed "$CONF_DIR/containers.conf" "# Written by coldsnap's scripts/install-containers.sh; used through CONTAINERS_CONF.
[containers]
# podman's default rlimits (nofile, nproc) cannot be set in these hosts' containers.
default_ulimits = []

[engine]
# No systemd: cgroups are made directly. runc: crun fails on hybrid (v1 + v2) cgroups here.
cgroup_manager = \"cgroupfs\"
events_logger = \"file\"
runtime = \"runc\""
write_if_changed "$CONF_DIR/storage.conf" "# Written by coldsnap's scripts/install-containers.sh; used through CONTAINERS_STORAGE_CONF.
# vfs: every layer is a full copy (no overlay module or fuse needed); delete graphroot to drop every image.
[storage]
driver = \"vfs\"
graphroot = \"$STORAGE_ROOT\"
runroot = \"$RUN_ROOT\""

# The check: both tools answer with this configuration.
eval "$(print_env)"
buildah --version >/dev/null || die "buildah does not run"
podman --version >/dev/null || die "podman does not run"
runc --version >/dev/null || die "runc does not run"
log "ready: $(buildah --version | head -n1), $(podman --version), runc $(runc --version | sed -n 's/^runc version //p')"
log "use: eval \"\$(bash scripts/install-containers.sh --print-env)\""
