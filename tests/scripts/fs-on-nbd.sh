#!/usr/bin/env bash
# Filesystem smoke test on an NBD export.
#
#   tests/scripts/fs-on-nbd.sh nbd://127.0.0.1:10809/vol     # any NBD server
#   tests/scripts/fs-on-nbd.sh --zebu                         # a 3-replica Zebu volume
#
# Needs root, /dev/fuse, loop devices, nbdfuse (libnbd-bin), e2fsprogs.
# Steps: nbdfuse exposes the export as a regular file in a temp dir; a loop device with
# direct I/O attaches that file (so the page cache of the loop device does not hide the
# server: every block goes over NBD); mkfs.ext4, mount, write files of random data and record
# their sha256, sync, drop caches, verify the checksums, unmount, then `e2fsck -fn` must find
# a clean filesystem. Cleanup (umount, losetup -d, FUSE unmount, Zebu processes) runs on
# every exit via a trap. Environment: FILES (default 32) files of FILE_MB (default 4) MiB
# each.
#
# With --zebu the script starts three `zebu-replica serve` on 127.0.0.11, .12 and .13 and a
# `zebu-engine serve --frontend nbd` over them (binaries from ZEBU_BIN_DIR, default
# target/debug, built when missing), with a SIZE (default 1G) volume. KILL_REPLICA=1 kills
# the third replica with SIGKILL once half of the files are written (the rest are written
# on two replicas); RESTART_ENGINE=1 then stops the engine with SIGTERM after the checks,
# starts it again on the two surviving replicas, and checks the files and the filesystem once
# more through a fresh nbdfuse and loop device. tests/tests/nbd_engine.rs has the same
# scenario as a Rust test.
# Exit status 0 means every check passed.
set -euo pipefail

url=${1:?usage: $0 NBD_URL | --zebu}
files=${FILES:-32}
file_mb=${FILE_MB:-4}

[[ $(id -u) -eq 0 ]] || { echo "fs-on-nbd: must run as root" >&2; exit 2; }

work=$(mktemp -d /tmp/fs-on-nbd.XXXXXX)
fuse_dir=$work/fuse
mnt=$work/mnt
mkdir -p "$fuse_dir" "$mnt"
loopdev=
fuse_pid=
zebu_pids=()     # engine first, then replicas
engine_pid=

log() { echo "fs-on-nbd: $*" >&2; }

detach() {
    if mountpoint -q "$mnt"; then umount "$mnt" || umount -l "$mnt"; fi
    [[ -n $loopdev ]] && losetup -d "$loopdev"
    loopdev=
    if mountpoint -q "$fuse_dir"; then
        if command -v fusermount3 >/dev/null; then fusermount3 -u "$fuse_dir"
        elif command -v fusermount >/dev/null; then fusermount -u "$fuse_dir"
        else umount "$fuse_dir" || umount -l "$fuse_dir"; fi
    fi
    [[ -n $fuse_pid ]] && wait "$fuse_pid" 2>/dev/null
    fuse_pid=
    return 0
}

cleanup() {
    local rc=$?
    set +e
    detach
    [[ -n $engine_pid ]] && kill "$engine_pid" 2>/dev/null && wait "$engine_pid" 2>/dev/null
    for pid in "${zebu_pids[@]}"; do kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null; done
    [[ $rc -ne 0 && -d $work/zebu ]] && tail -n 20 "$work"/zebu/*.log >&2
    rm -rf "$work"
    if [[ $rc -eq 0 ]]; then log "PASS"; else log "FAIL (exit $rc)"; fi
    exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Waits for a line starting with PREFIX in FILE (written by process PID); prints its rest.
wait_line() {
    local file=$1 prefix=$2 pid=$3 line
    for _ in $(seq 1 600); do
        line=$(grep -m1 "^$prefix" "$file" 2>/dev/null || true)
        [[ -n $line ]] && { echo "${line#"$prefix"}"; return 0; }
        kill -0 "$pid" 2>/dev/null || { log "process $pid exited; see $file"; return 1; }
        sleep 0.1
    done
    return 1
}

start_engine() {
    local args=() a
    for a in "$@"; do args+=(--replica "$a"); done
    "$zebu_bin/zebu-engine" serve --volume fs --size "$zebu_size" "${args[@]}" \
        --control 127.0.0.1:0 --frontend nbd --nbd-listen 127.0.0.1:0 --io-timeout 2s \
        >"$work/zebu/engine.out" 2>>"$work/zebu/engine.log" &
    engine_pid=$!
    wait_line "$work/zebu/engine.out" ready "$engine_pid" >/dev/null
    url=$(wait_line "$work/zebu/engine.out" "nbd " "$engine_pid")
    log "engine $engine_pid serves $url"
}

replica_addrs=()
if [[ $url == --zebu ]]; then
    repo=$(cd "$(dirname "$0")/../.." && pwd)
    zebu_bin=${ZEBU_BIN_DIR:-$repo/target/debug}
    if [[ -z ${ZEBU_BIN_DIR:-} ]]; then
        (cd "$repo" && cargo build -q -p zebu-engine -p zebu-replica \
            --bin zebu-engine --bin zebu-replica)
    fi
    zebu_size=$(numfmt --from=iec "${SIZE:-1G}")
    mkdir -p "$work/zebu"
    for i in 1 2 3; do
        "$zebu_bin/zebu-replica" serve --dir "$work/zebu/r$i" --listen "127.0.0.1$i:0" \
            --size "$zebu_size" >"$work/zebu/r$i.out" 2>"$work/zebu/r$i.log" &
        zebu_pids+=($!)
        replica_addrs+=("$(wait_line "$work/zebu/r$i.out" "listening on " $!)")
    done
    start_engine "${replica_addrs[@]}"
fi

attach() {
    log "exposing $url through nbdfuse"
    nbdfuse "$fuse_dir/disk" "$url" &
    fuse_pid=$!
    for _ in $(seq 1 100); do
        [[ -e $fuse_dir/disk ]] && break
        kill -0 "$fuse_pid" 2>/dev/null || { log "nbdfuse exited"; exit 1; }
        sleep 0.1
    done
    [[ -e $fuse_dir/disk ]] || { log "nbdfuse did not expose the export"; exit 1; }
    log "export size $(stat -c %s "$fuse_dir/disk") bytes"
    loopdev=$(losetup --find --show --direct-io=on "$fuse_dir/disk")
    log "attached $loopdev (direct-io=$(cat /sys/block/"${loopdev#/dev/}"/loop/dio 2>/dev/null || echo ?))"
}

# Unmounts, checks the filesystem, mounts again and verifies every checksum.
check() {
    umount "$mnt"
    log "checking filesystem with e2fsck -fn"
    e2fsck -fn "$loopdev"
    # Remount: the data must still be there after a clean unmount.
    mount "$loopdev" "$mnt"
    (cd "$mnt" && sha256sum --quiet -c SHA256SUMS)
    cmp "$work/sums" "$mnt/SHA256SUMS"
    umount "$mnt"
}

attach
mkfs.ext4 -q -F "$loopdev"
mount "$loopdev" "$mnt"

log "writing $files files of $file_mb MiB"
for i in $(seq 1 "$files"); do
    head -c "$((file_mb << 20))" /dev/urandom > "$mnt/f$i"
    if [[ ${KILL_REPLICA:-0} == 1 && $i -eq $((files / 2)) && ${#zebu_pids[@]} -eq 3 ]]; then
        sync
        log "kill -9 of replica ${replica_addrs[2]} after $i files"
        kill -9 "${zebu_pids[2]}"
        wait "${zebu_pids[2]}" 2>/dev/null || true
        unset 'zebu_pids[2]'
        unset 'replica_addrs[2]'
    fi
done
mkdir -p "$mnt/dir/nested"
echo "small file" > "$mnt/dir/nested/small"
(cd "$mnt" && find . -type f ! -name SHA256SUMS -print0 | sort -z | xargs -0 sha256sum) > "$work/sums"
cp "$work/sums" "$mnt/SHA256SUMS"
sync

# Drop the page cache so the verification reads come from the device, not memory.
echo 3 > /proc/sys/vm/drop_caches
log "verifying checksums"
(cd "$mnt" && sha256sum --quiet -c "$work/sums")
cmp "$work/sums" "$mnt/SHA256SUMS"
check

if [[ ${RESTART_ENGINE:-0} == 1 && -n $engine_pid ]]; then
    detach
    log "restarting the engine (SIGTERM, then start on ${replica_addrs[*]})"
    kill "$engine_pid"
    wait "$engine_pid" || { log "engine exited with $? on SIGTERM"; exit 1; }
    engine_pid=
    start_engine "${replica_addrs[@]}"
    attach
    mount "$loopdev" "$mnt"
    check
fi
