#!/usr/bin/env bash
# install-criu.sh - install a working CRIU into a private prefix, without
# touching the machine's apt configuration or its system libraries.
#
# Why this exists:
#   * Debian 12's own criu (3.17) does not work on recent kernels (6.x, e.g. 6.18).
#   * trixie's criu 4.1.1 cannot dump TCP sockets on such kernels.
#   * CRIU 4.2.1 (Debian sid) works, but sid's packages cannot be installed on
#     bookworm with apt/dpkg without dragging in a newer libc for the whole
#     system. So we unpack criu (from sid) plus the libraries it needs (from
#     trixie, including trixie's glibc) into a private prefix and run it through
#     that prefix's own dynamic loader:
#         PREFIX/.../ld-linux-x86-64.so.2 --library-path PREFIX/... PREFIX/usr/sbin/criu
#     Nothing is registered with dpkg, and the host libc is never mixed in.
#     Because the loader is given --library-path (not LD_LIBRARY_PATH), programs
#     that criu itself executes (iptables, nft, action scripts) run unaffected
#     with the host's own libraries.
#   * The criu binary itself is built by scripts/build-criu.sh: upstream 4.2.1 plus
#     scripts/criu/thp-fill.patch and parallel-fill.patch (CRIU_THP_FILL=1 fills a restore's
#     private memory into huge pages, CRIU_FILL_THREADS=N on N more threads), against exactly
#     the libraries of the prefix. It replaces sid's
#     usr/sbin/criu there; --stock keeps sid's binary.
#   * The downloads use a private, throw-away apt setup (own sources list,
#     lists, cache, empty status, no host apt.conf.d / preferences / sources.list.d),
#     so the machine's apt sources and state are never changed.
#
# Modes:  see usage() below, or run with --help.
set -euo pipefail

PROG=install-criu

# ---------------------------------------------------------------- settings --
EXPECTED_VERSION="${COLDSNAP_CRIU_VERSION:-4.2.1}"    # upstream criu version we insist on
MIRROR="${COLDSNAP_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
DEFAULT_PREFIX=/opt/coldsnap/criu
DEFAULT_DEBS=/var/cache/coldsnap/criu-debs
DEFAULT_LINK_DIR=/usr/local/bin

# criu and the libraries only sid has in the needed version ...
SID_PKGS=(criu libcompel1 libnet9 libnl-3-200)
# ... and everything else from trixie, glibc included (the prefix is self-contained).
TRIXIE_PKGS=(libc6 libbsd0 libgnutls30t64 libnftables1 libprotobuf-c1 libuuid1 libmd0
             libnettle8t64 libhogweed6t64 libgmp10 libidn2-0 libunistring5 libtasn1-6
             libp11-kit0 libffi8 libmnl0 libnftnl11 libjansson4 libxtables12 libedit2
             libbpf1 libelf1t64 zlib1g libtinfo6 libcap2 libbz2-1.0 liblzma5 libzstd1)
ALL_PKGS=("${SID_PKGS[@]}" "${TRIXIE_PKGS[@]}")

MULTIARCH=x86_64-linux-gnu
LDSO_NAME=ld-linux-x86-64.so.2
STAMP_NAME=.coldsnap-criu.stamp
BUILT_NAME=criu-$EXPECTED_VERSION-coldsnap          # the built binary, beside the .debs
BUILT_BINARY="coldsnap (thp-fill.patch, parallel-fill.patch, kdat-dir.patch)" STOCK_BINARY="debian sid"  # the stamp's binary= line
SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# What the built binary must have been built from (its .source file), as scripts/build-criu.sh writes it.
patches_sha256() { bash "$SCRIPT_DIR/build-criu.sh" --patches-sha256; }
SUMS_NAME=SHA256SUMS

# ----------------------------------------------------------------- helpers --
log() { printf '%s: %s\n' "$PROG" "$*" >&2; }
die() { printf '%s: ERROR: %s\n' "$PROG" "$*" >&2; exit 1; }

usage() {
    cat <<EOF
Usage:
  ${0##*/} [--prefix DIR] [--debs DIR] [--link DIR | --no-link] [--force] [--stock]
      Install CRIU $EXPECTED_VERSION. Downloads the .debs into the debs folder
      unless it already holds all of them, builds coldsnap's criu binary there
      (scripts/build-criu.sh, about a minute) unless it is there already,
      unpacks the .debs into the prefix, puts the built binary in, writes the
      wrapper PREFIX/bin/criu and symlinks it as DIR/criu.
  ${0##*/} --download-only DIR [--stock]
      Only download the .debs and build the binary (plus a $SUMS_NAME file)
      into DIR, e.g. to carry them to an offline machine.
  ${0##*/} --from-debs DIR [--prefix DIR] [--link DIR | --no-link] [--force] [--stock]
      Offline install from .debs (and the built binary, $BUILT_NAME) already
      in DIR; never touches the network and needs no apt at all (works on e.g.
      Ubuntu 24.04 too). Without the built binary there, sid's is installed,
      with a warning.

Options:
  --prefix DIR   install prefix (default: $DEFAULT_PREFIX)
  --debs DIR     .deb cache folder (default: $DEFAULT_DEBS)
  --link DIR     where to symlink the wrapper as 'criu' (default: $DEFAULT_LINK_DIR)
  --no-link      do not create the symlink
  --force        reinstall even if the prefix is already complete
  --stock        Debian sid's criu binary as it is: no build, no huge-page fill
  -h, --help     show this help

What gets installed:
  from Debian sid:    ${SID_PKGS[*]}
  from Debian trixie: ${TRIXIE_PKGS[*]}
  built here:         usr/sbin/criu = $EXPECTED_VERSION + scripts/criu/{thp-fill,parallel-fill,kdat-dir}.patch
                      (\`criu --version\` names GitID v$EXPECTED_VERSION-coldsnap-thp-fill+parallel+kdat-dir)
  The binary runs via the prefix's own loader, so the host libc is untouched:
    PREFIX/usr/lib/$MULTIARCH/$LDSO_NAME --library-path PREFIX/usr/lib/$MULTIARCH PREFIX/usr/sbin/criu
  A second run with everything in place does nothing heavy and exits 0.
  The prefix is built in a temporary folder next to it and renamed into place,
  so a failed run never leaves a half-installed prefix.

Downloads use a private apt setup in a temporary folder (own sources list,
lists, cache; host sources.list.d, apt.conf.d and preferences are ignored);
the machine's apt sources and state are not changed. The host's
Acquire::Check-Valid-Until, Acquire::Check-Date and http/https proxy settings
are carried over.

Environment:
  COLDSNAP_CRIU_VERSION    expected upstream criu version (default 4.2.1)
  COLDSNAP_DEBIAN_MIRROR   Debian mirror (default http://deb.debian.org/debian)
  COLDSNAP_DEBIAN_KEYRINGS comma-separated keyring files for signed-by
                           (default: /usr/share/keyrings/debian-archive-keyring.gpg
                           plus debian-archive-trixie-{automatic,stable}.gpg if present)
EOF
}

# Paths scheduled for removal on exit (temporary dirs, half-built prefixes).
CLEANUP=()
cleanup() {
    local p
    for p in "${CLEANUP[@]+"${CLEANUP[@]}"}"; do
        [ -n "$p" ] && [ -e "$p" ] && rm -rf -- "$p"
    done
    return 0
}
trap cleanup EXIT
trap 'exit 130' INT TERM

need_cmd() { command -v "$1" >/dev/null 2>&1 || die "required command '$1' not found"; }

# Strip epoch and Debian revision: "1:4.2.1-1+b1" -> "4.2.1".
upstream_version() { local v=${1#*:}; printf '%s\n' "${v%-*}"; }

# The .deb files of our package set in a folder.
# Sets DEB[pkg]=path for each package found, MISSING=(pkgs not found) and
# DEB_CRIU_VER (upstream version of the criu .deb, "" if absent).
# Dies if a package has more than one .deb there (ambiguous).
declare -A DEB
MISSING=()
DEB_CRIU_VER=""
BUILT=""
scan_debs() {
    local dir=$1 pkg
    local -a f
    DEB=(); MISSING=(); DEB_CRIU_VER=""; BUILT=""
    # The built binary counts only if it was built from this checkout's patches.
    if [ $STOCK -eq 0 ] && [ -f "$dir/$BUILT_NAME" ] &&
       [ "$(cat "$dir/$BUILT_NAME.source" 2>/dev/null)" = "patch=$(patches_sha256)" ]; then
        BUILT=$dir/$BUILT_NAME
    fi
    if [ ! -d "$dir" ]; then MISSING=("${ALL_PKGS[@]}"); return 0; fi
    for pkg in "${ALL_PKGS[@]}"; do
        # "pkg_" prefix: libc6_* does not match libc6-dev_*.
        mapfile -t f < <(compgen -G "$dir/${pkg}_*_amd64.deb"; compgen -G "$dir/${pkg}_*_all.deb")
        case ${#f[@]} in
            0) MISSING+=("$pkg") ;;
            1) DEB[$pkg]=${f[0]} ;;
            *) die "several .debs for $pkg in $dir: ${f[*]##*/} (remove the stale ones)" ;;
        esac
    done
    if [ -n "${DEB[criu]:-}" ]; then
        local v
        v=$(dpkg-deb -f "${DEB[criu]}" Version) && [ -n "$v" ] ||
            die "cannot read the version of ${DEB[criu]} (corrupt .deb?)"
        DEB_CRIU_VER=$(upstream_version "$v")
    fi
}

# Do we have the complete set, with the expected criu version?
have_debs() { [ ${#MISSING[@]} -eq 0 ] && [ "$DEB_CRIU_VER" = "$EXPECTED_VERSION" ]; }

# "sha256  basename" lines for the scanned set, sorted (stable manifest).
deb_manifest() {
    local pkg
    {
        for pkg in "${ALL_PKGS[@]}"; do
            (cd "$(dirname "${DEB[$pkg]}")" && sha256sum -- "$(basename "${DEB[$pkg]}")")
        done
        [ -z "$BUILT" ] || (cd "$(dirname "$BUILT")" && sha256sum -- "$BUILT_NAME")
    } | LC_ALL=C sort -k2
}

# Build coldsnap's criu binary from the .debs in $1 (scripts/build-criu.sh), then rewrite the
# folder's checksum file to cover it.
build_binary() {
    local dir=$1
    log "building coldsnap's criu binary into $dir/$BUILT_NAME (scripts/build-criu.sh; --stock skips this)"
    bash "$SCRIPT_DIR/build-criu.sh" --debs "$dir" --out "$dir/$BUILT_NAME" ||
        die "building criu failed (see above); --stock installs Debian's binary without the huge-page fill"
    scan_debs "$dir"
    deb_manifest >"$dir/.$SUMS_NAME.tmp" && mv -f "$dir/.$SUMS_NAME.tmp" "$dir/$SUMS_NAME"
}

# Human-readable total size of the scanned set.
deb_total_size() {
    local pkg
    for pkg in "${ALL_PKGS[@]}"; do printf '%s\0' "${DEB[$pkg]}"; done |
        du -ch --files0-from=- | tail -n1 | cut -f1
}

# Version reported by a criu wrapper ("Version: 4.2.1"), empty if it fails.
wrapper_version() {
    local out
    out=$("$@" --version 2>/dev/null) || return 0
    printf '%s\n' "$out" | sed -n 's/^Version:[[:space:]]*//p' | head -n1
}

# ---------------------------------------------------------------- download --
# Download the full package set into $1 using a private, temporary apt setup.
download_debs() {
    local dest=$1 state keyrings="" k pkg cand
    need_cmd apt-get; need_cmd apt-cache; need_cmd apt-config
    [ "$(dpkg --print-architecture 2>/dev/null || echo amd64)" = amd64 ] ||
        log "warning: host is not amd64; downloading amd64 packages anyway"

    state=$(mktemp -d "${TMPDIR:-/tmp}/install-criu-apt.XXXXXX")
    CLEANUP+=("$state")
    # apt drops privileges to _apt for downloads: it must be able to traverse
    # the state dir and write into the download dir, else apt warns and
    # downloads unsandboxed as root.
    chmod 755 "$state"
    mkdir -p "$state"/etc/{apt.conf.d,preferences.d,sources.list.d,trusted.gpg.d} \
             "$state"/lists/partial "$state"/cache/archives/partial "$state"/dl
    : >"$state/status"
    if id _apt >/dev/null 2>&1; then chown _apt "$state/dl" 2>/dev/null || true; fi

    # Keyrings. The bookworm debian-archive-keyring.gpg already holds the
    # bookworm/trixie archive keys that sign sid and trixie; the separate
    # trixie keyrings are added when present for robustness.
    if [ -n "${COLDSNAP_DEBIAN_KEYRINGS:-}" ]; then
        keyrings=$COLDSNAP_DEBIAN_KEYRINGS
    else
        for k in /usr/share/keyrings/debian-archive-keyring.gpg \
                 /usr/share/keyrings/debian-archive-trixie-automatic.gpg \
                 /usr/share/keyrings/debian-archive-trixie-stable.gpg; do
            [ -r "$k" ] && keyrings=${keyrings:+$keyrings,}$k
        done
    fi
    [ -n "$keyrings" ] || die "no Debian archive keyring found (install debian-archive-keyring or set COLDSNAP_DEBIAN_KEYRINGS)"

    # Carry over the host's acquire policy (proxies, validity checks): e.g. a
    # mirror/cache serving frozen Release files needs Check-Valid-Until=false.
    local HOST_VU=true HOST_CD=true HOST_HP="" HOST_HSP=""
    eval "$(apt-config shell HOST_VU Acquire::Check-Valid-Until/b HOST_CD Acquire::Check-Date/b \
                             HOST_HP Acquire::http::Proxy HOST_HSP Acquire::https::Proxy)"

    # Private apt configuration. Dir::Etc is relocated as a whole, so the host's
    # sources.list(.d), apt.conf.d (hooks!), preferences(.d) and trusted.gpg(.d)
    # are all ignored; status is empty so installed packages play no role.
    cat >"$state/apt.conf" <<EOF
Dir::Etc "$state/etc";
Dir::Etc::SourceList "$state/etc/sources.list";
Dir::Etc::SourceParts "$state/etc/sources.list.d";
Dir::State "$state";
Dir::State::Lists "$state/lists";
Dir::State::status "$state/status";
Dir::Cache "$state/cache";
Dir::Cache::archives "$state/cache/archives";
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
APT::Architecture "amd64";
APT::Architectures { "amd64"; };
Acquire::Languages "none";
Acquire::GzipIndexes "true";
Acquire::Check-Valid-Until "$HOST_VU";
Acquire::Check-Date "$HOST_CD";
EOF
    [ -n "$HOST_HP" ] && printf 'Acquire::http::Proxy "%s";\n' "$HOST_HP" >>"$state/apt.conf"
    [ -n "$HOST_HSP" ] && printf 'Acquire::https::Proxy "%s";\n' "$HOST_HSP" >>"$state/apt.conf"
    cat >"$state/etc/sources.list" <<EOF
deb [signed-by=$keyrings] $MIRROR sid main
deb [signed-by=$keyrings] $MIRROR trixie main
EOF
    export APT_CONFIG="$state/apt.conf"

    log "updating private apt lists (sid + trixie from $MIRROR)"
    apt-get -q update >&2 || die "apt-get update failed (network? keyring? see above)"

    # Check the version before spending bandwidth on it.
    cand=$(apt-cache show --no-all-versions criu/sid 2>/dev/null | sed -n 's/^Version: //p' | head -n1)
    [ -n "$cand" ] || die "criu not found in sid"
    if [ "$(upstream_version "$cand")" != "$EXPECTED_VERSION" ]; then
        die "sid now carries criu $cand, expected $EXPECTED_VERSION (set COLDSNAP_CRIU_VERSION=$(upstream_version "$cand") to accept it, after testing)"
    fi
    log "sid has criu $cand"

    local -a args=()
    for pkg in "${SID_PKGS[@]}"; do args+=("$pkg/sid"); done
    for pkg in "${TRIXIE_PKGS[@]}"; do args+=("$pkg/trixie"); done
    log "downloading ${#args[@]} packages"
    (cd "$state/dl" && apt-get -q download "${args[@]}" >&2) || die "apt-get download failed"
    unset APT_CONFIG

    scan_debs "$state/dl"
    [ ${#MISSING[@]} -eq 0 ] || die "download incomplete, missing: ${MISSING[*]}"
    [ "$DEB_CRIU_VER" = "$EXPECTED_VERSION" ] || die "downloaded criu is $DEB_CRIU_VER, expected $EXPECTED_VERSION"

    # Move into place, replacing other versions of the same packages, then
    # write the checksum file used to verify a carried copy offline.
    mkdir -p "$dest"
    for pkg in "${ALL_PKGS[@]}"; do
        rm -f -- "$dest/${pkg}"_*_amd64.deb "$dest/${pkg}"_*_all.deb
        mv -f -- "${DEB[$pkg]}" "$dest/"
        # apt's _apt sandbox user owns the downloaded files: hand them back.
        chown "$(id -u):$(id -g)" -- "$dest/${DEB[$pkg]##*/}" 2>/dev/null || true
        chmod 644 -- "$dest/${DEB[$pkg]##*/}"
    done
    rm -f -- "$dest/$BUILT_NAME" "$dest/$BUILT_NAME.source"  # built against the .debs replaced just now
    scan_debs "$dest"
    deb_manifest >"$dest/.$SUMS_NAME.tmp" && mv -f "$dest/.$SUMS_NAME.tmp" "$dest/$SUMS_NAME"
    log "downloaded ${#ALL_PKGS[@]} .debs ($(deb_total_size)) into $dest"
}

# Verify the .debs in $1 against its SHA256SUMS (if present); 1 on mismatch.
verify_sums() {
    local dir=$1
    if [ -f "$dir/$SUMS_NAME" ]; then
        if ! (cd "$dir" && sha256sum --quiet -c "$SUMS_NAME" >&2); then
            log "checksum mismatch in $dir (see above)"
            return 1
        fi
    else
        log "note: no $SUMS_NAME in $dir, cannot verify the .debs' integrity"
    fi
}

# ------------------------------------------------------------------ unpack --
# Resolve $2 (path relative to root $1) through symlinks *inside* the root
# (an absolute link target such as /lib64/ld-linux-x86-64.so.2 ->
# /lib/x86_64-linux-gnu/... must not escape to the host's files).
# Prints the resulting relative path of a regular file.
resolve_in_root() {
    local root=$1 rel=$2 n=0 tgt
    while [ -L "$root/$rel" ]; do
        n=$((n + 1)); [ $n -le 16 ] || return 1
        tgt=$(readlink -- "$root/$rel")
        case $tgt in
            /*) rel=${tgt#/} ;;
            *)  rel=$(dirname -- "$rel")/$tgt ;;
        esac
        rel=$(realpath -s -m --relative-to="$root" -- "$root/$rel")
    done
    [ -f "$root/$rel" ] || return 1
    printf '%s\n' "$rel"
}

# Unpack the scanned set into a fresh prefix and swap it into place.
install_prefix() {
    local prefix=$1 parent base tmp rel ldso="" libpath="" d pkg
    parent=$(dirname -- "$prefix"); base=$(basename -- "$prefix")
    mkdir -p -- "$parent"
    tmp=$(mktemp -d "$parent/.$base.new.XXXXXX")
    CLEANUP+=("$tmp")
    chmod 755 "$tmp"

    log "unpacking ${#ALL_PKGS[@]} .debs into $tmp"
    for pkg in "${ALL_PKGS[@]}"; do
        dpkg-deb -x "${DEB[$pkg]}" "$tmp" || die "dpkg-deb -x failed for ${DEB[$pkg]}"
    done
    [ -x "$tmp/usr/sbin/criu" ] || die "usr/sbin/criu missing after unpacking"
    local binary=$STOCK_BINARY
    if [ -n "$BUILT" ]; then
        install -m 755 -- "$BUILT" "$tmp/usr/sbin/criu"
        binary=$BUILT_BINARY
    fi

    # Where the loader lands depends on the libc6 build (trixie: a regular file
    # in usr/lib/<triplet>, plus a /lib64 or /usr/lib64 symlink with an
    # absolute target). Take the first candidate that resolves inside the prefix.
    for rel in usr/lib/$MULTIARCH/$LDSO_NAME lib/$MULTIARCH/$LDSO_NAME usr/lib64/$LDSO_NAME lib64/$LDSO_NAME; do
        if [ -e "$tmp/$rel" ] || [ -L "$tmp/$rel" ]; then
            ldso=$(resolve_in_root "$tmp" "$rel") && break
            ldso=""
        fi
    done
    [ -n "$ldso" ] || die "$LDSO_NAME not found in the unpacked libc6"
    # Library dirs: usr/lib/<triplet>, plus lib/<triplet> if some package
    # still ships files there (no usrmerge symlinks inside the prefix).
    for d in usr/lib/$MULTIARCH lib/$MULTIARCH; do
        if [ -d "$tmp/$d" ] && [ ! -L "$tmp/$d" ]; then libpath=${libpath:+$libpath:}$d; fi
    done
    log "loader: $ldso; library path: $libpath"

    # Self-check against the temporary tree: every library criu loads must
    # resolve inside the prefix (the loader would otherwise silently fall back
    # to the host's ld.so.cache), and it must report the expected version.
    local tlib list bad ver
    tlib=$(printf '%s' "$libpath" | sed "s|[^:][^:]*|$tmp/&|g")
    list=$("$tmp/$ldso" --library-path "$tlib" --list "$tmp/usr/sbin/criu" 2>&1) ||
        die "criu ($binary) does not load with the private loader:"$'\n'"$list"
    bad=$(printf '%s\n' "$list" | grep -v -e "=> $tmp/" -e "^[[:space:]]*$tmp/" -e 'linux-vdso' || true)
    [ -z "$bad" ] || die "libraries not resolved inside the prefix:"$'\n'"$bad"
    ver=$(wrapper_version "$tmp/$ldso" --library-path "$tlib" "$tmp/usr/sbin/criu")
    [ "$ver" = "$EXPECTED_VERSION" ] || die "unpacked criu reports version '${ver:-?}', expected $EXPECTED_VERSION"

    # Wrapper with absolute paths of the *final* prefix.
    local abslib
    abslib=$(printf '%s' "$libpath" | sed "s|[^:][^:]*|$prefix/&|g")
    mkdir -p "$tmp/bin"
    cat >"$tmp/bin/criu" <<EOF
#!/bin/sh
# Generated by install-criu.sh: CRIU $EXPECTED_VERSION (Debian sid) with Debian trixie
# libraries in a private prefix, run through the prefix's own dynamic loader so
# that the host's libc is never used (and nothing leaks into child processes).
exec "$prefix/$ldso" --library-path "$abslib" "$prefix/usr/sbin/criu" "\$@"
EOF
    chmod 755 "$tmp/bin/criu"

    {
        echo "# coldsnap criu prefix, written by install-criu.sh - do not edit"
        echo "version=$EXPECTED_VERSION"
        echo "ldso=$ldso"
        echo "libpath=$libpath"
        echo "binary=$binary"
        deb_manifest
    } >"$tmp/$STAMP_NAME"

    # Swap into place: rename the old prefix aside, the new one in, then drop
    # the old one. Both renames are within one directory (same filesystem).
    if [ -e "$prefix" ] || [ -L "$prefix" ]; then
        local old
        old=$(mktemp -d "$parent/.$base.old.XXXXXX")
        rmdir "$old"
        mv -T -- "$prefix" "$old"
        if ! mv -T -- "$tmp" "$prefix"; then
            mv -T -- "$old" "$prefix" || true
            die "could not rename $tmp to $prefix"
        fi
        rm -rf -- "$old"
    else
        mv -T -- "$tmp" "$prefix"
    fi
    log "installed criu $EXPECTED_VERSION ($binary binary) into $prefix"
}

# Symlink the wrapper as LINKDIR/criu (atomically replaces an older symlink).
make_link() {
    local prefix=$1 dir=$2 link
    link=$dir/criu
    if [ -L "$link" ] && [ "$(readlink -- "$link")" = "$prefix/bin/criu" ]; then
        return 0
    fi
    if [ -e "$link" ] && [ ! -L "$link" ]; then
        die "$link exists and is not a symlink; remove it or use --no-link / --link DIR"
    fi
    mkdir -p -- "$dir"
    ln -s -- "$prefix/bin/criu" "$dir/.criu.new.$$"
    mv -Tf -- "$dir/.criu.new.$$" "$link"
    log "linked $link -> $prefix/bin/criu"
}

# Is the prefix complete, with the expected version and (if given) built from
# exactly the .debs described by manifest $2?
prefix_is_current() {
    local prefix=$1 manifest=${2:-} stamp
    stamp=$prefix/$STAMP_NAME
    [ -f "$stamp" ] && [ -x "$prefix/bin/criu" ] || return 1
    grep -qx "version=$EXPECTED_VERSION" "$stamp" || return 1
    grep -qx "binary=$WANT_BINARY" "$stamp" || return 1
    if [ -n "$manifest" ]; then
        [ "$(grep -E '^[0-9a-f]{64}  ' "$stamp")" = "$manifest" ] || return 1
    fi
    [ "$(wrapper_version "$prefix/bin/criu")" = "$EXPECTED_VERSION" ]
}

# -------------------------------------------------------------------- main --
MODE=install PREFIX=$DEFAULT_PREFIX DEBS=$DEFAULT_DEBS LINK_DIR=$DEFAULT_LINK_DIR
DO_LINK=1 FORCE=0 OFFLINE=0 STOCK=0
while [ $# -gt 0 ]; do
    case $1 in
        -h|--help) usage; exit 0 ;;
        --prefix) [ $# -ge 2 ] || die "--prefix needs a DIR"; PREFIX=$2; shift ;;
        --debs) [ $# -ge 2 ] || die "--debs needs a DIR"; DEBS=$2; shift ;;
        --link) [ $# -ge 2 ] || die "--link needs a DIR"; LINK_DIR=$2; DO_LINK=1; shift ;;
        --no-link) DO_LINK=0 ;;
        --force) FORCE=1 ;;
        --stock) STOCK=1 ;;
        --download-only)
            [ $# -ge 2 ] || die "--download-only needs a DIR"
            [ $OFFLINE -eq 0 ] || die "--download-only and --from-debs exclude each other"
            MODE=download; DEBS=$2; shift ;;
        --from-debs)
            [ $# -ge 2 ] || die "--from-debs needs a DIR"
            [ $MODE = install ] || die "--download-only and --from-debs exclude each other"
            OFFLINE=1; DEBS=$2; shift ;;
        *) die "unknown argument '$1' (see --help)" ;;
    esac
    shift
done

[ "$(uname -m)" = x86_64 ] || die "only x86_64 is supported (this is $(uname -m))"
need_cmd dpkg-deb; need_cmd tar; need_cmd sha256sum; need_cmd mktemp; need_cmd realpath
DEBS=$(realpath -m -- "$DEBS")

if [ $MODE = download ]; then
    scan_debs "$DEBS"
    if [ $FORCE -eq 0 ] && have_debs && verify_sums "$DEBS"; then
        log "all ${#ALL_PKGS[@]} .debs already in $DEBS ($(deb_total_size)), nothing to download"
    else
        download_debs "$DEBS"
    fi
    [ $STOCK -eq 1 ] || [ -n "$BUILT" ] || build_binary "$DEBS"
    exit 0
fi

# The prefix path is baked into the wrapper script: keep it simple and safe.
PREFIX=$(realpath -m -- "$PREFIX")
case $PREFIX in
    /|/usr|/usr/local|/opt|/bin|/lib|/etc|/var|/home|/root) die "refusing prefix '$PREFIX'" ;;
esac
[[ $PREFIX =~ ^[A-Za-z0-9._/+-]+$ ]] || die "prefix '$PREFIX' contains unsupported characters"
if [ -d "$PREFIX" ] && [ ! -f "$PREFIX/$STAMP_NAME" ] && [ -n "$(ls -A -- "$PREFIX")" ]; then
    die "$PREFIX exists, is not empty and was not made by this script; refusing to replace it"
fi
[ $DO_LINK -eq 0 ] || LINK_DIR=$(realpath -m -- "$LINK_DIR")

# Serialize concurrent runs: lock the prefix's parent directory (no lock file
# left behind).
if command -v flock >/dev/null 2>&1; then
    mkdir -p -- "$(dirname -- "$PREFIX")"
    exec 9<"$(dirname -- "$PREFIX")"
    flock -w 600 9 || die "another install-criu.sh is working in $(dirname -- "$PREFIX")"
fi

# What .debs do we have?
scan_debs "$DEBS"
HAVE_DEBS=0
if have_debs; then HAVE_DEBS=1; fi

# The binary the prefix should have: the built one, unless --stock or an offline folder without it.
WANT_BINARY=$BUILT_BINARY
if [ $STOCK -eq 1 ] || { [ $OFFLINE -eq 1 ] && [ -z "$BUILT" ]; }; then WANT_BINARY=$STOCK_BINARY; fi

# Fast path: prefix complete and current. If a full set of .debs is at hand,
# it must be the one the prefix was built from (so fresh .debs get installed).
if [ $FORCE -eq 0 ]; then
    manifest=""
    [ $HAVE_DEBS -eq 0 ] || manifest=$(deb_manifest)
    if prefix_is_current "$PREFIX" "$manifest"; then
        log "criu $EXPECTED_VERSION already installed in $PREFIX, nothing to do"
        [ $DO_LINK -eq 0 ] || make_link "$PREFIX" "$LINK_DIR"
        exit 0
    fi
fi

if [ $HAVE_DEBS -eq 1 ] && ! verify_sums "$DEBS"; then
    [ $OFFLINE -eq 0 ] || die "--from-debs: the .debs in $DEBS are damaged; copy them again"
    log "downloading them again"
    HAVE_DEBS=0
fi
if [ $HAVE_DEBS -eq 0 ]; then
    if [ $OFFLINE -eq 1 ]; then
        [ -d "$DEBS" ] || die "--from-debs: $DEBS does not exist"
        [ ${#MISSING[@]} -eq 0 ] || die "--from-debs: missing .debs in $DEBS for: ${MISSING[*]}"
        die "--from-debs: $DEBS holds criu $DEB_CRIU_VER, expected $EXPECTED_VERSION"
    fi
    download_debs "$DEBS"
else
    log "using the .debs in $DEBS ($(deb_total_size))"
fi
if [ $STOCK -eq 0 ] && [ -z "$BUILT" ]; then
    if [ $OFFLINE -eq 1 ]; then
        log "warning: no $BUILT_NAME built from this checkout's patch in $DEBS: installing Debian's criu binary, without the huge-page fill (make the folder with --download-only to include it)"
    else
        build_binary "$DEBS"
    fi
fi

install_prefix "$PREFIX"
ver=$(wrapper_version "$PREFIX/bin/criu")
[ "$ver" = "$EXPECTED_VERSION" ] || die "$PREFIX/bin/criu reports '${ver:-?}', expected $EXPECTED_VERSION"
[ $DO_LINK -eq 0 ] || make_link "$PREFIX" "$LINK_DIR"
log "done: $PREFIX/bin/criu --version -> $ver"
