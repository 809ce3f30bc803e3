#!/usr/bin/env bash
# build-criu.sh - build coldsnap's CRIU: upstream 4.2.1 plus the patches of scripts/criu/series
# (thp-fill.patch: huge pages for CRIU's page fill; parallel-fill.patch: that fill on several threads),
# compiled against the very libraries that install-criu.sh puts in its private
# prefix, so the binary replaces the prefix's usr/sbin/criu and runs through the prefix's own loader.
#
# Usage:
#   build-criu.sh --debs DIR --out FILE [--work DIR] [--jobs N]
#     DIR   the runtime .debs install-criu.sh downloaded (criu from sid, libraries from trixie)
#     FILE  where the stripped binary goes (written atomically), with FILE.source naming the patches' sha256
#   build-criu.sh --patches-sha256    only print that sha256 (install-criu.sh compares it with FILE.source)
#
# How: the criu source tarball comes from Debian's sid index (sha256 checked against it); the -dev
# packages for the sysroot are only downloaded, with a private throw-away apt setup (trixie, plus sid
# for libnl-3 and libnet as the runtime set has them), and unpacked with dpkg-deb -x next to the
# runtime .debs of DIR. Every runtime library is checked to be the same package version as DIR's.
# The host only gets Debian's build tools (gcc make pkgconf protobuf-compiler protobuf-c-compiler
# libprotobuf-dev xz-utils curl) through its own apt, if they are missing. The host's apt sources
# and state are never changed. About a minute on 2 cores.
set -euo pipefail

PROG=build-criu
VERSION=${COLDSNAP_CRIU_VERSION:-4.2.1}
MIRROR="${COLDSNAP_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
PATCHES=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/criu
MULTIARCH=x86_64-linux-gnu
# GitID in `criu --version`: how coldsnap tells its CRIU (it fills huge pages) from a stock one.
GITID="v$VERSION-coldsnap-thp-fill+parallel+kdat-dir"
DEV_PKGS=(libc6-dev linux-libc-dev libprotobuf-c-dev libnl-3-dev libnet1-dev libcap-dev libnftables-dev
          libgnutls28-dev libbsd-dev uuid-dev)
HOST_TOOLS=(gcc make pkgconf protobuf-compiler protobuf-c-compiler libprotobuf-dev xz-utils curl)

log() { printf '%s: %s\n' "$PROG" "$*" >&2; }
die() { printf '%s: ERROR: %s\n' "$PROG" "$*" >&2; exit 1; }

usage() { sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; }

[ -r "$PATCHES/series" ] || die "missing $PATCHES/series"
mapfile -t SERIES < <(grep -v '^#' "$PATCHES/series" | grep .)
for p in "${SERIES[@]}"; do [ -r "$PATCHES/$p" ] || die "missing $PATCHES/$p (named in series)"; done
# What a binary is built from, in its FILE.source: the patches in their order.
patches_sha256() { (cd "$PATCHES" && cat "${SERIES[@]}") | sha256sum | cut -d' ' -f1; }

DEBS="" OUT="" WORK="" JOBS=$(nproc)
while [ $# -gt 0 ]; do
    case $1 in
        -h|--help) usage; exit 0 ;;
        --patches-sha256) patches_sha256; exit 0 ;;
        --debs) [ $# -ge 2 ] || die "--debs needs a DIR"; DEBS=$2; shift ;;
        --out) [ $# -ge 2 ] || die "--out needs a FILE"; OUT=$2; shift ;;
        --work) [ $# -ge 2 ] || die "--work needs a DIR"; WORK=$2; shift ;;
        --jobs) [ $# -ge 2 ] || die "--jobs needs N"; JOBS=$2; shift ;;
        *) die "unknown argument '$1' (see --help)" ;;
    esac
    shift
done
[ -n "$DEBS" ] && [ -n "$OUT" ] || die "--debs DIR and --out FILE are required (see --help)"
[ -d "$DEBS" ] || die "no folder $DEBS"
DEBS=$(realpath -- "$DEBS")
OUT=$(realpath -m -- "$OUT")

CLEANUP=()
cleanup() { local p; for p in "${CLEANUP[@]+"${CLEANUP[@]}"}"; do rm -rf -- "$p"; done; }
trap cleanup EXIT
trap 'exit 130' INT TERM
if [ -z "$WORK" ]; then
    WORK=$(mktemp -d "${TMPDIR:-/tmp}/build-criu.XXXXXX")
    CLEANUP+=("$WORK")
fi
mkdir -p "$WORK"
chmod 755 "$WORK"  # apt downloads as _apt

# ------------------------------------------------------------ host tools --
missing=()
for p in "${HOST_TOOLS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    [ "$(id -u)" = 0 ] || die "build tools missing (${missing[*]}); install them or run as root"
    log "installing build tools with the host's apt: ${missing[*]}"
    # The host's own configuration: never a private APT_CONFIG here.
    env -u APT_CONFIG DEBIAN_FRONTEND=noninteractive apt-get install -q -y --no-install-recommends "${missing[@]}" >&2 ||
        { env -u APT_CONFIG apt-get -q update >&2 &&
          env -u APT_CONFIG DEBIAN_FRONTEND=noninteractive apt-get install -q -y --no-install-recommends "${missing[@]}" >&2; } ||
        die "could not install the build tools"
fi

# ------------------------------------------------- source (Debian sid) --
log "finding criu $VERSION in Debian sid's source index"
curl -fsS -o "$WORK/Sources.xz" "$MIRROR/dists/sid/main/source/Sources.xz" || die "cannot fetch $MIRROR/dists/sid/main/source/Sources.xz"
orig=criu_$VERSION.orig.tar.xz
xz -dc "$WORK/Sources.xz" >"$WORK/Sources"
entry=$(awk -v name="$orig" '
    /^Package: /{criu=($2=="criu"); dir=""; sha=""} criu && /^Directory: /{dir=$2}
    criu && /^Checksums-Sha256:/{sums=1; next} /^[^ ]/{sums=0}
    criu && sums && $3==name {sha=$1}
    /^$/ && criu && dir != "" && sha != "" {print dir, sha; exit}' "$WORK/Sources")
[ -n "$entry" ] || die "sid's index has no $orig"
read -r dir sha <<<"$entry"
curl -fsS -o "$WORK/$orig" "$MIRROR/$dir/$orig" || die "cannot download $MIRROR/$dir/$orig"
echo "$sha  $WORK/$orig" | sha256sum -c --status || die "$orig does not match the sha256 of sid's index"

# ------------------------------------------------------------- sysroot --
keyrings=""
for k in /usr/share/keyrings/debian-archive-keyring.gpg /usr/share/keyrings/debian-archive-trixie-automatic.gpg \
         /usr/share/keyrings/debian-archive-trixie-stable.gpg; do
    [ -r "$k" ] && keyrings=${keyrings:+$keyrings,}$k
done
[ -n "$keyrings" ] || die "no Debian archive keyring found (install debian-archive-keyring)"
apt=$WORK/apt
mkdir -p "$apt"/etc/{apt.conf.d,preferences.d,sources.list.d} "$apt"/lists/partial "$apt"/cache/archives/partial
: >"$apt/status"
cat >"$apt/etc/sources.list" <<EOF
deb [signed-by=$keyrings] $MIRROR trixie main
deb [signed-by=$keyrings] $MIRROR sid main
EOF
cat >"$apt/etc/preferences" <<'EOF'
Package: libnl-3-200 libnl-3-dev libnet9 libnet1-dev
Pin: release n=sid
Pin-Priority: 995
EOF
cat >"$apt/apt.conf" <<EOF
Dir::Etc "$apt/etc";
Dir::State "$apt";
Dir::State::Lists "$apt/lists";
Dir::State::status "$apt/status";
Dir::Cache "$apt/cache";
APT::Architecture "amd64";
APT::Architectures { "amd64"; };
APT::Default-Release "trixie";
APT::Install-Recommends "false";
Acquire::Languages "none";
EOF
# The host's acquire policy carried over, as install-criu.sh does (a mirror serving frozen Release
# files needs Check-Valid-Until=false; proxies).
HOST_VU=true HOST_CD=true HOST_HP="" HOST_HSP=""
eval "$(apt-config shell HOST_VU Acquire::Check-Valid-Until/b HOST_CD Acquire::Check-Date/b \
                         HOST_HP Acquire::http::Proxy HOST_HSP Acquire::https::Proxy)"
printf 'Acquire::Check-Valid-Until "%s";\nAcquire::Check-Date "%s";\n' "$HOST_VU" "$HOST_CD" >>"$apt/apt.conf"
[ -z "$HOST_HP" ] || printf 'Acquire::http::Proxy "%s";\n' "$HOST_HP" >>"$apt/apt.conf"
[ -z "$HOST_HSP" ] || printf 'Acquire::https::Proxy "%s";\n' "$HOST_HSP" >>"$apt/apt.conf"
# The private configuration is given per command, never exported.
log "downloading the sysroot's -dev packages (private apt: trixie; sid for libnl-3, libnet)"
APT_CONFIG="$apt/apt.conf" apt-get -q update >&2 || die "apt-get update failed (network? keyring?)"
APT_CONFIG="$apt/apt.conf" apt-get -q -y --download-only install "${DEV_PKGS[@]}" >&2 || die "downloading the -dev packages failed"
sysroot=$WORK/sysroot
mkdir -p "$sysroot/usr/lib" "$sysroot/usr/lib64"
ln -s usr/lib "$sysroot/lib"; ln -s usr/lib64 "$sysroot/lib64"  # merged /usr: libc.so's absolute paths
for deb in "$apt"/cache/archives/*.deb; do
    pkg=$(dpkg-deb -f "$deb" Package)
    runtime=$(compgen -G "$DEBS/${pkg}_*_amd64.deb" || true)
    if [ -n "$runtime" ] && [ "$(dpkg-deb -f "$runtime" Version)" != "$(dpkg-deb -f "$deb" Version)" ]; then
        die "$pkg: the sysroot would have $(dpkg-deb -f "$deb" Version), the runtime set $(dpkg-deb -f "$runtime" Version) (download both again)"
    fi
    dpkg-deb -x "$deb" "$sysroot"
done
for deb in "$DEBS"/*.deb; do dpkg-deb -x "$deb" "$sysroot"; done  # what the binary runs with, exactly

# --------------------------------------------------------------- build --
log "building criu $VERSION with ${SERIES[*]}"
tar -C "$WORK" -xf "$WORK/$orig"
src=$WORK/criu-$VERSION
for p in "${SERIES[@]}"; do
    patch -d "$src" -p1 --quiet --no-backup-if-mismatch <"$PATCHES/$p" || die "$p does not apply to criu $VERSION"
done
export PKG_CONFIG_LIBDIR=$sysroot/usr/lib/$MULTIARCH/pkgconfig:$sysroot/usr/share/pkgconfig
export PKG_CONFIG_SYSROOT_DIR=$sysroot PKG_CONFIG_PATH=
# Debian's default hardening flags; SOURCE_DATE_EPOCH (from the patches) keeps KDAT_MAGIC_2, CRIU's
# kernel-facts cache key, the same for every build of one patch.
export CFLAGS="-fstack-protector-strong -fstack-clash-protection -fcf-protection -Wformat -Werror=format-security"
export SOURCE_DATE_EPOCH=$((16#$(patches_sha256 | cut -c1-7)))
started=$(date +%s)
# The target compiler is the host's gcc over the sysroot (-B/-L put its crt*.o and libc.so first);
# HOSTCC builds compel-host, which runs during the build. descriptor.proto comes from the host's
# libprotobuf-dev.
make -C "$src" -j"$JOBS" criu GITID="$GITID" \
    CC="gcc --sysroot=$sysroot -B$sysroot/usr/lib/$MULTIARCH/ -L$sysroot/usr/lib/$MULTIARCH" HOSTCC=gcc \
    GOOGLE_INCLUDE=/usr/include/google/protobuf >"$WORK/make.log" 2>&1 ||
    { tail -n 30 "$WORK/make.log" >&2; die "make failed (log above)"; }
log "built in $(( $(date +%s) - started )) s"

mkdir -p "$(dirname "$OUT")"
strip --strip-unneeded --remove-section=.comment -o "$OUT.tmp.$$" "$src/criu/criu"
chmod 755 "$OUT.tmp.$$"
printf 'patch=%s\n' "$(patches_sha256)" >"$OUT.source.tmp.$$"
mv -f "$OUT.tmp.$$" "$OUT"
mv -f "$OUT.source.tmp.$$" "$OUT.source"  # what it was built from: install-criu.sh rebuilds when a patch changes
log "wrote $OUT ($(du -h "$OUT" | cut -f1), sha256 $(sha256sum "$OUT" | cut -c1-16)…)"
