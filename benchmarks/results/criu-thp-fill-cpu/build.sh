#!/usr/bin/env bash
# build.sh - build CRIU 4.2.1 (Debian sid source) + thp-fill.patch against a
# private sysroot made of the SAME Debian trixie/sid library packages that the
# runtime prefix /opt/coldsnap/criu carries, so that the binary runs as
#   PREFIX/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2 \
#       --library-path PREFIX/usr/lib/x86_64-linux-gnu /tmp/criu-build/criu ...
#
# Host: Debian 12 (bookworm) x86_64. Host packages (bookworm only, normal apt):
#   gcc make pkgconf protobuf-compiler protobuf-c-compiler libprotobuf-dev
#   xz-utils curl. Everything from trixie/sid is only DOWNLOADED with a private
#   apt setup (own sources.list, lists, cache, empty dpkg status) and unpacked
#   with dpkg-deb -x into $TOP/sysroot; nothing from trixie/sid is installed on
#   the host and the host's apt configuration is never changed.
#
# Non-interactive and idempotent: downloads and the sysroot are reused when
# present; the source tree is re-extracted and re-patched on every run.
# Usage: ./build.sh            (env: JOBS=N, TOP=/tmp/criu-build)
set -euo pipefail

TOP=${TOP:-/tmp/criu-build}
JOBS=${JOBS:-$(nproc)}
MIRROR=http://deb.debian.org/debian
SECMIRROR=http://deb.debian.org/debian-security
VERSION=4.2.1
DEBVER=4.2.1-1
PATCH=$TOP/thp-fill.patch
SYSROOT=$TOP/sysroot
APTDIR=$TOP/apt
SRCDIR=$TOP/src
BUILDDIR=$TOP/work
MA=x86_64-linux-gnu

log() { printf '[build.sh %(%T)T] %s\n' -1 "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

mkdir -p "$TOP" "$SRCDIR" "$BUILDDIR" "$TOP/idx"
cd "$TOP"

# ------------------------------------------------------------ host tools --
need_pkgs=()
for p in gcc make pkgconf protobuf-compiler protobuf-c-compiler libprotobuf-dev xz-utils curl; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || need_pkgs+=("$p")
done
if [ ${#need_pkgs[@]} -gt 0 ]; then
	log "installing bookworm build tools: ${need_pkgs[*]}"
	# plain host apt (bookworm sources); NO private APT_CONFIG here
	env -u APT_CONFIG DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${need_pkgs[@]}"
fi

# ------------------------------------------------ criu source from sid ------
if [ ! -s idx/sid-Sources.xz ]; then
	log "fetching sid Sources index"
	curl -fsS -o idx/sid-Sources.xz.tmp "$MIRROR/dists/sid/main/source/Sources.xz"
	mv idx/sid-Sources.xz.tmp idx/sid-Sources.xz
fi
[ -s idx/sid-Sources ] || xz -dc idx/sid-Sources.xz > idx/sid-Sources
stanza=$(awk -v v="$DEBVER" '
	/^Package: /{p=($2=="criu")} p && /^Version: /{ok=($2==v)} p{buf=buf $0 "\n"}
	/^$/{ if (p && ok) {printf "%s", buf; exit} buf=""; p=0; ok=0 }' idx/sid-Sources)
[ -n "$stanza" ] || die "criu $DEBVER not found in sid Sources"
dir=$(printf '%s' "$stanza" | awk '/^Directory: /{print $2}')
# "sha256 size name" lines of the Checksums-Sha256 field
sums=$(printf '%s' "$stanza" | awk '/^Checksums-Sha256:/{f=1;next} /^[^ ]/{f=0} f{print $1, $3}')
log "criu $DEBVER source: $MIRROR/$dir/"
while read -r sha name; do
	if [ ! -s "$SRCDIR/$name" ] || ! echo "$sha  $SRCDIR/$name" | sha256sum -c --status; then
		if curl -fsS -o "$SRCDIR/$name.tmp" "$MIRROR/$dir/$name"; then
			mv "$SRCDIR/$name.tmp" "$SRCDIR/$name"
		else
			rm -f "$SRCDIR/$name.tmp"
			case "$name" in
			*.debian.tar.*) log "WARNING: $name not downloadable (only upstream orig is needed for 'make criu')"; continue ;;
			*) die "cannot download $MIRROR/$dir/$name" ;;
			esac
		fi
	fi
	echo "$sha  $SRCDIR/$name" | sha256sum -c --status || die "sha256 mismatch: $name"
	log "ok $name"
done <<<"$sums"
ORIG=$SRCDIR/criu_$VERSION.orig.tar.xz
[ -s "$ORIG" ] || die "missing $ORIG"

# ------------------------------------- sysroot: trixie (+ 2 sid) -dev debs --
# Versions pinned to what /opt/coldsnap/criu carries (libc6 2.41-12+deb13u5,
# libnet9 1.3+dfsg-3+b2 and libnl-3-200 3.12.0-2+b1 from sid, rest trixie).
DEV_PKGS=(libc6-dev linux-libc-dev libprotobuf-c-dev libnl-3-dev libnet1-dev libcap-dev
	  libnftables-dev libgnutls28-dev libbsd-dev uuid-dev)
EXPECT=(libc6=2.41-12+deb13u5 libnet9=1.3+dfsg-3+b2 libnl-3-200=3.12.0-2+b1
	libprotobuf-c1=1.5.1-1 libgnutls30t64=3.8.9-3+deb13u4 libnftables1=1.1.3-1
	libbsd0=0.12.2-2 libuuid1=2.41.5-0+deb13u1)
APTCONF=$APTDIR/apt.conf
mkdir -p "$APTDIR"/{etc/apt.conf.d,etc/preferences.d,etc/sources.list.d,lists/partial,cache/archives/partial,state}
: > "$APTDIR/state/status.tmp"; [ -e "$APTDIR/state/status" ] || mv "$APTDIR/state/status.tmp" "$APTDIR/state/status"
rm -f "$APTDIR/state/status.tmp"
cat > "$APTDIR/etc/sources.list" <<EOF
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $MIRROR trixie main
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $MIRROR trixie-updates main
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $SECMIRROR trixie-security main
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $MIRROR sid main
EOF
cat > "$APTDIR/etc/preferences" <<'EOF'
Package: *
Pin: release n=trixie-security
Pin-Priority: 990

Package: libnl-3-200 libnl-3-dev libnet9 libnet1-dev
Pin: release n=sid
Pin-Priority: 995
EOF
cat > "$APTCONF" <<EOF
Dir::Etc "$APTDIR/etc";
Dir::Etc::sourcelist "$APTDIR/etc/sources.list";
Dir::Etc::sourceparts "$APTDIR/etc/sources.list.d";
Dir::Etc::parts "$APTDIR/etc/apt.conf.d";
Dir::Etc::preferences "$APTDIR/etc/preferences";
Dir::Etc::preferencesparts "$APTDIR/etc/preferences.d";
Dir::State "$APTDIR/state";
Dir::State::Lists "$APTDIR/lists";
Dir::State::status "$APTDIR/state/status";
Dir::Cache "$APTDIR/cache";
APT::Architecture "amd64";
APT::Architectures { "amd64"; };
APT::Default-Release "trixie";
APT::Install-Recommends "false";
Acquire::Languages "none";
Acquire::Check-Valid-Until "false";
Debug::NoLocking "true";
EOF
# The private config is only ever passed per command, for update / download-only.
papt() { APT_CONFIG="$APTCONF" "$@"; }
if [ ! -e "$SYSROOT/.stamp" ]; then
	log "private apt: update + download-only (trixie/sid)"
	papt apt-get -q update
	papt apt-get -q -y --download-only install "${DEV_PKGS[@]}"
	mkdir -p "$TOP/debs"
	cp -f "$APTDIR"/cache/archives/*.deb "$TOP/debs/"
	for e in "${EXPECT[@]}"; do
		p=${e%%=*} v=${e#*=}
		ls "$TOP/debs/${p}_${v}_"*.deb >/dev/null 2>&1 ||
			die "$p $v not among the downloaded debs (prefix mismatch)"
	done
	log "unpacking $(ls "$TOP"/debs/*.deb | wc -l) debs into $SYSROOT"
	rm -rf "$SYSROOT.tmp"; mkdir -p "$SYSROOT.tmp"
	# merged-/usr layout, so libc.so's /lib/... and /lib64/... resolve in the sysroot
	ln -s usr/lib "$SYSROOT.tmp/lib"; ln -s usr/lib64 "$SYSROOT.tmp/lib64"
	for d in "$TOP"/debs/*.deb; do dpkg-deb -x "$d" "$SYSROOT.tmp"; done
	(cd "$TOP/debs" && ls *.deb) > "$SYSROOT.tmp/.debs"
	touch "$SYSROOT.tmp/.stamp"
	rm -rf "$SYSROOT"; mv "$SYSROOT.tmp" "$SYSROOT"
fi
# the libraries linked against must be byte-identical to the runtime prefix's
PREFIX_LIB=/opt/coldsnap/criu/usr/lib/$MA
if [ -d "$PREFIX_LIB" ]; then
	for f in libc.so.6 libnet.so.9 libnl-3.so.200 libprotobuf-c.so.1 libgnutls.so.30 libnftables.so.1 libbsd.so.0 libuuid.so.1; do
		cmp -s "$(readlink -f "$SYSROOT/usr/lib/$MA/$f")" "$(readlink -f "$PREFIX_LIB/$f")" ||
			log "WARNING: $f in sysroot differs from $PREFIX_LIB/$f"
	done
fi

# ------------------------------------------------------ source + patch -----
log "extracting criu-$VERSION and applying $(basename "$PATCH")"
rm -rf "$BUILDDIR/criu-$VERSION"
tar -C "$BUILDDIR" -xf "$ORIG"
(cd "$BUILDDIR/criu-$VERSION" && patch -p1 --no-backup-if-mismatch < "$PATCH")

# ----------------------------------------------------------------- build ----
# The target compiler: host gcc-12 with the trixie sysroot. -B/-L put the
# sysroot's crt*.o / libc.so ahead of gcc's built-in host search paths.
# HOSTCC (compel-host, run during the build) stays plain host gcc.
# GOOGLE_INCLUDE: descriptor.proto from the host's libprotobuf-dev (3.21.12,
# same version as trixie's).
# CFLAGS: Debian's default hardening compile flags (dpkg-buildflags).
export PKG_CONFIG_LIBDIR=$SYSROOT/usr/lib/$MA/pkgconfig:$SYSROOT/usr/share/pkgconfig
export PKG_CONFIG_SYSROOT_DIR=$SYSROOT
export PKG_CONFIG_PATH=
export CFLAGS="-fstack-protector-strong -fstack-clash-protection -fcf-protection -Wformat -Werror=format-security"
# Reproducible build: criu/Makefile.crtools bakes $(date +%s) into KDAT_MAGIC_2
# (the /run/criu.kdat cache key) unless SOURCE_DATE_EPOCH is set. Derive it
# from the patch, so a different patch also gets a different kdat cache key.
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$((16#$(sha256sum "$PATCH" | cut -c1-7)))}
TCC="gcc --sysroot=$SYSROOT -B$SYSROOT/usr/lib/$MA/ -L$SYSROOT/usr/lib/$MA"
log "make -j$JOBS criu"
start=$(date +%s)
make -C "$BUILDDIR/criu-$VERSION" -j"$JOBS" criu \
	CC="$TCC" HOSTCC=gcc GOOGLE_INCLUDE=/usr/include/google/protobuf V=1 \
	> "$TOP/make.log" 2>&1 || { tail -40 "$TOP/make.log"; die "make failed, see $TOP/make.log"; }
end=$(date +%s)
log "make took $((end - start)) s"

BIN=$BUILDDIR/criu-$VERSION/criu/criu
cp -f "$BIN" "$TOP/criu.unstripped"
strip --strip-unneeded --remove-section=.comment -o "$TOP/criu" "$BIN"
log "built $TOP/criu"
readelf -d "$TOP/criu" | awk '/NEEDED/{print "  NEEDED " $NF}' >&2
if [ -x "$PREFIX_LIB/ld-linux-x86-64.so.2" ]; then
	"$PREFIX_LIB/ld-linux-x86-64.so.2" --library-path "$PREFIX_LIB" "$TOP/criu" --version >&2
fi
