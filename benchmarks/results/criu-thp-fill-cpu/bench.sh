#!/usr/bin/env bash
# bench.sh - time `criu restore -d` of a 4 GiB private-anon workload (bench.py):
# stock /opt/coldsnap/criu/bin/criu vs /tmp/criu-build/criu with CRIU_THP_FILL=1,
# plus the patched binary without the variable and (optionally) stock with
# transparent_hugepage/enabled=always (always put back to madvise).
#
# Usage: bench.sh [RUNS] [SIZE_GIB] [extra bench.py args, e.g. --fork]
#   env: THP_ALWAYS=0 skips the THP=always run; KEEP_IMG=1 keeps the images;
#        REUSE=1 reuses the images/workload data of the previous KEEP_IMG=1 run;
#        ORDER=seq (default: stock x RUNS, then patched x RUNS) or
#        ORDER=interleave (stock, patched, stock, patched, ...);
#        ORDER=noenv (stock and patched-without-CRIU_THP_FILL alternating);
#        PREWARM_GIB=N: right before each timed restore, touch and free N GiB
#        (THP-advised) so the guest RAM the fill gets is host-backed (this VM
#        has virtio free page reporting, see results.txt); TAG=name for the
#        results file bench/results-TAG.raw.
#
# Restored processes are re-parented to this script's subreaper (PID 1 here
# does not reap orphans), so their PIDs really become free between runs.
set -euo pipefail
if [ -z "${BENCH_REAPER:-}" ]; then
	exec /usr/bin/python3 -c '
import ctypes, os, sys
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)   # PR_SET_CHILD_SUBREAPER
os.environ["BENCH_REAPER"] = "1"
pid = os.fork()
if pid == 0:
    os.execvp("bash", ["bash"] + sys.argv[1:])
rc = 1
while True:
    try:
        p, st = os.wait()
    except ChildProcessError:
        break
    if p == pid:
        rc = os.waitstatus_to_exitcode(st)
        break
sys.exit(rc)
' "$0" "$@"
fi

TOP=/tmp/criu-build
RUNS=${1:-3}
SIZE=${2:-4}
shift $(( $# >= 2 ? 2 : $# )) || true
WL_ARGS=("$@")
B=$TOP/bench
IMG=$B/img
OUT=$B/out
P=/opt/coldsnap/criu/usr/lib/x86_64-linux-gnu
STOCK=(/opt/coldsnap/criu/bin/criu)
NEW=("$P/ld-linux-x86-64.so.2" --library-path "$P" "$TOP/criu")
THP=/sys/kernel/mm/transparent_hugepage/enabled

log() { printf '[bench %(%T)T] %s\n' -1 "$*" >&2; }
now() { date +%s.%N; }
thp_mode() { sed 's/.*\[\(.*\)\].*/\1/' "$THP"; }

wait_gone() { # pid
	local i
	for i in $(seq 1 600); do [ -e "/proc/$1" ] || return 0; sleep 0.1; done
	log "pid $1 still there"; return 1
}

TAG=${TAG:-$(date +%H%M%S)}
RES=$B/results-$TAG.raw
LOGS=$B/logs-$TAG
[ "$(thp_mode)" = madvise ] || { log "THP mode is $(thp_mode), expected madvise"; exit 1; }
if [ "${REUSE:-0}" = 1 ]; then
	[ -s "$OUT/ready" ] && [ -s "$OUT/sum.start" ] && [ -d "$IMG" ] || { log "nothing to reuse"; exit 1; }
	mkdir -p "$LOGS"; : > "$RES"
else
	rm -rf "$IMG" "$OUT"; mkdir -p "$IMG" "$OUT" "$LOGS"; : > "$RES"
fi

# ------------------------------------------------------------- workload ----
if [ "${REUSE:-0}" != 1 ]; then
log "starting workload: ${SIZE} GiB ${WL_ARGS[*]:-}"
setsid -f /usr/bin/python3 "$TOP/bench.py" "$OUT" "$SIZE" "${WL_ARGS[@]}" \
	< /dev/null > "$OUT/stdout" 2> "$OUT/stderr"
for i in $(seq 1 1200); do [ -s "$OUT/ready" ] && break; sleep 0.1; done
[ -s "$OUT/ready" ] || { log "workload not ready"; cat "$OUT/stderr"; exit 1; }
PID=$(cat "$OUT/ready")
read -r SUM0 ADDR LEN < "$OUT/sum.start"
log "workload pid $PID, vma $ADDR len $LEN sha256 $SUM0"
grep -E 'Rss|AnonHugePages' "/proc/$PID/smaps_rollup" | tr -s ' ' >&2

# ----------------------------------------------------------------- dump ----
t0=$(now)
"${STOCK[@]}" dump -t "$PID" -D "$IMG" -o "$LOGS/dump.log" -v4
t1=$(now)
log "stock dump: $(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.3f", b-a}') s, image $(du -sh "$IMG" | cut -f1)"
wait_gone "$PID"
[ ! -s "$OUT/child" ] || wait_gone "$(cat "$OUT/child")"
fi
PID=$(cat "$OUT/ready")
read -r SUM0 ADDR LEN < "$OUT/sum.start"

vma_flags() { # pid addr -> "VmFlags..." of the big VMA
	awk -v a="$(printf '%x' "$2")" '
		$1 ~ /^[0-9a-f]+-[0-9a-f]+$/ { split($1, r, "-"); cur = (r[1] == a) }
		cur && /^VmFlags:/ { $1 = ""; print; exit }' "/proc/$1/smaps"
}
vma_field() { # pid addr field
	awk -v a="$(printf '%x' "$2")" -v f="$3:" '
		$1 ~ /^[0-9a-f]+-[0-9a-f]+$/ { split($1, r, "-"); cur = (r[1] == a) }
		cur && $1 == f { print $2; exit }' "/proc/$1/smaps"
}
fill_time() { # restore log -> seconds between first Preadv and last "returned"
	awk '/Preadv / && !s { gsub(/[()]/, "", $1); s = $1 } /`- returned/ { gsub(/[()]/, "", $1); e = $1 }
		END { if (s != "") printf "%.3f", e - s; else printf "n/a" }' "$1"
}

prewarm() { # GiB: touch + free THP-advised anon memory (not timed)
	/usr/bin/python3 -c '
import mmap, sys
n = int(float(sys.argv[1]) * (1 << 30)); c = 64 << 20; z = b"\1" * c
m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
m.madvise(mmap.MADV_HUGEPAGE)
for off in range(0, n, c):
    m[off:off + c] = z
m.close()
' "$1"
}

run_restore() { # label env-assignment-or-"-" binary...
	local label=$1 envv=$2; shift 2
	local log_=$LOGS/restore-$label.log
	rm -f "$OUT"/sum.[0-9]*
	cat "$IMG"/pages-*.img > /dev/null   # page cache warm (not timed)
	[ "${PREWARM_GIB:-0}" = 0 ] || prewarm "$PREWARM_GIB"
	local t0 t1 rc=0 tfa0 tsp0
	tfa0=$(awk '/^thp_fault_alloc /{print $2}' /proc/vmstat)
	tsp0=$(awk '/^thp_split_pmd /{print $2}' /proc/vmstat)
	t0=$(now)
	if [ "$envv" = - ]; then
		env -u CRIU_THP_FILL "$@" restore -D "$IMG" -d -o "$log_" -v4 || rc=$?
	else
		env "$envv" "$@" restore -D "$IMG" -d -o "$log_" -v4 || rc=$?
	fi
	t1=$(now)
	local wall; wall=$(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.3f", b-a}')
	if [ $rc -ne 0 ] || [ ! -e "/proc/$PID" ]; then
		log "$label: restore FAILED rc=$rc"; tail -5 "$log_" >&2
		printf '%s\twall=%s\tFAILED rc=%s\n' "$label" "$wall" "$rc" >> "$RES"
		return 0
	fi
	local tfa tsp
	tfa=$(( $(awk '/^thp_fault_alloc /{print $2}' /proc/vmstat) - tfa0 ))
	tsp=$(( $(awk '/^thp_split_pmd /{print $2}' /proc/vmstat) - tsp0 ))
	# VmFlags of every VMA, to compare runs (e.g. stock vs patched without CRIU_THP_FILL)
	awk '$1 ~ /^[0-9a-f]+-[0-9a-f]+$/ { r = $1 } /^VmFlags:/ { $1 = ""; print r $0 }' "/proc/$PID/smaps" > "$LOGS/vmflags-$label.txt"
	local ahp rss ahp_vma flags thpfill
	ahp=$(awk '/^AnonHugePages:/{print $2}' "/proc/$PID/smaps_rollup")
	rss=$(awk '/^Rss:/{print $2}' "/proc/$PID/smaps_rollup")
	ahp_vma=$(vma_field "$PID" "$ADDR" AnonHugePages)
	flags=$(vma_flags "$PID" "$ADDR")
	case " $flags " in *" hg "*) hg=yes ;; *) hg=no ;; esac
	thpfill=$(grep -c 'THP fill' "$log_" || true)
	kill -USR1 "$PID"
	local i
	for i in $(seq 1 1200); do [ -s "$OUT/sum.1" ] && break; sleep 0.1; done
	local sum1=missing
	[ -s "$OUT/sum.1" ] && read -r sum1 _ < "$OUT/sum.1"
	local ok=BAD; [ "$sum1" = "$SUM0" ] && ok=ok
	kill -KILL "$PID"; [ ! -s "$OUT/child" ] || kill -KILL "$(cat "$OUT/child")" 2>/dev/null || true
	wait_gone "$PID"; [ ! -s "$OUT/child" ] || wait_gone "$(cat "$OUT/child")"
	printf '%s\twall=%.3f\tfill=%s\tRss=%skB\tAnonHugePages=%skB\tvmaAnonHugePages=%skB\tVM_HUGEPAGE(hg)=%s\tTHPfillLogLines=%s\tthp_fault_alloc=+%s\tthp_split_pmd=+%s\tchecksum=%s\n' \
		"$label" "$wall" "$(fill_time "$log_")" "$rss" "$ahp" "$ahp_vma" "$hg" "$thpfill" "$tfa" "$tsp" "$ok" | tee -a "$RES" >&2
}

if [ "${ORDER:-seq}" = noenv ]; then
	# stock vs patched WITHOUT CRIU_THP_FILL, alternating (both must be 4K fills)
	for r in $(seq 1 "$RUNS"); do
		run_restore "stock-$r" - "${STOCK[@]}"
		[ "$r" = "$RUNS" ] || run_restore "patched-noenv-$((r + 1))" - "${NEW[@]}"
	done
elif [ "${ORDER:-seq}" = interleave ]; then
	for r in $(seq 1 "$RUNS"); do
		run_restore "stock-$r" - "${STOCK[@]}"
		run_restore "patched-thpfill-$r" CRIU_THP_FILL=1 "${NEW[@]}"
	done
else
	for r in $(seq 1 "$RUNS"); do run_restore "stock-$r" - "${STOCK[@]}"; done
	for r in $(seq 1 "$RUNS"); do run_restore "patched-thpfill-$r" CRIU_THP_FILL=1 "${NEW[@]}"; done
fi
run_restore "patched-noenv-1" - "${NEW[@]}"

if [ "${THP_ALWAYS:-1}" = 1 ]; then
	trap 'echo madvise > "$THP"; log "THP mode restored: $(thp_mode)"' EXIT INT TERM
	echo always > "$THP"
	log "THP mode now: $(thp_mode)"
	run_restore "stock-thp-always-1" - "${STOCK[@]}" || true
	echo madvise > "$THP"
	trap - EXIT INT TERM
	log "THP mode restored: $(thp_mode)"
fi

if [ -s "$LOGS/vmflags-stock-1.txt" ] && [ -s "$LOGS/vmflags-patched-noenv-1.txt" ]; then
	if diff "$LOGS/vmflags-stock-1.txt" "$LOGS/vmflags-patched-noenv-1.txt" > "$LOGS/vmflags-stock-vs-noenv.diff"; then
		log "VmFlags of all VMAs: stock-1 == patched-noenv-1"
		echo "VmFlags of all VMAs identical: stock-1 vs patched-noenv-1" >> "$RES"
	else
		log "VmFlags differ between stock-1 and patched-noenv-1, see $LOGS/vmflags-stock-vs-noenv.diff"
	fi
fi
[ "${KEEP_IMG:-0}" = 1 ] || { rm -rf "$IMG"; log "removed $IMG"; }
log "done; results in $RES"
cat "$RES"
