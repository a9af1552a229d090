#!/usr/bin/env bash
# Filesystem smoke test on an NBD export.
#
#   tests/scripts/fs-on-nbd.sh nbd://127.0.0.1:10809/vol
#
# Needs root, /dev/fuse, loop devices, nbdfuse (libnbd-bin), e2fsprogs.
# Steps: nbdfuse exposes the export as a regular file in a temp dir; a loop device with
# direct I/O attaches that file (so the page cache of the loop device does not hide the
# server: every block goes over NBD); mkfs.ext4, mount, write files of random data and record
# their sha256, sync, drop caches, verify the checksums, unmount, then `e2fsck -fn` must find
# a clean filesystem. Cleanup (umount, losetup -d, FUSE unmount) runs on every exit via a
# trap. Environment: FILES (default 32) files of FILE_MB (default 4) MiB each.
# Exit status 0 means every check passed.
set -euo pipefail

url=${1:?usage: $0 NBD_URL}
files=${FILES:-32}
file_mb=${FILE_MB:-4}

[[ $(id -u) -eq 0 ]] || { echo "fs-on-nbd: must run as root" >&2; exit 2; }

work=$(mktemp -d /tmp/fs-on-nbd.XXXXXX)
fuse_dir=$work/fuse
mnt=$work/mnt
mkdir -p "$fuse_dir" "$mnt"
loopdev=
fuse_pid=

log() { echo "fs-on-nbd: $*" >&2; }

cleanup() {
    local rc=$?
    set +e
    if mountpoint -q "$mnt"; then umount "$mnt" || umount -l "$mnt"; fi
    [[ -n $loopdev ]] && losetup -d "$loopdev"
    if mountpoint -q "$fuse_dir"; then
        if command -v fusermount3 >/dev/null; then fusermount3 -u "$fuse_dir"
        elif command -v fusermount >/dev/null; then fusermount -u "$fuse_dir"
        else umount "$fuse_dir"; fi
    fi
    [[ -n $fuse_pid ]] && wait "$fuse_pid" 2>/dev/null
    rm -rf "$work"
    if [[ $rc -eq 0 ]]; then log "PASS"; else log "FAIL (exit $rc)"; fi
    exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

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

mkfs.ext4 -q -F "$loopdev"
mount "$loopdev" "$mnt"

log "writing $files files of $file_mb MiB"
for i in $(seq 1 "$files"); do
    head -c "$((file_mb << 20))" /dev/urandom > "$mnt/f$i"
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

umount "$mnt"
log "checking filesystem with e2fsck -fn"
e2fsck -fn "$loopdev"

# Remount once more: the data must still be there after a clean unmount.
mount "$loopdev" "$mnt"
(cd "$mnt" && sha256sum --quiet -c SHA256SUMS)
umount "$mnt"
