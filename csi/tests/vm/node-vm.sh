#!/usr/bin/env bash
# node-vm.sh: a throw-away QEMU VM whose kernel has a real iSCSI initiator, for
# csi/tests/vm_iscsi.rs (the CSI node path on hosts whose own kernel has none).
#
#   node-vm.sh build
#       Makes (once) the VM's kernel and base initramfs from Debian packages: the kernel of
#       linux-image-amd64 with the modules for virtio networking, SCSI, iSCSI over TCP and
#       ext4; busybox; the real iscsiadm and iscsid (open-iscsi), mkfs.ext4 (e2fsprogs),
#       blkid, mount and umount (util-linux, mount) with their shared libraries. Cached in
#       $ZEBU_TOOLS_CACHE (default /var/cache/zebu-tools)/vm-iscsi-KERNEL-OPENISCSI-SCRIPT,
#       keyed by the kernel's and open-iscsi's versions and this script's checksum. Prints
#       the cache directory.
#   node-vm.sh run --csi BIN --portal IP:PORT --grpc-port N --shell-port N --console FILE
#                  --workdir DIR [--node NODE]
#       Boots the VM, replacing this shell with qemu (so the caller's pid is qemu's), with
#       BIN (zebu-csi, debug info stripped) added as a second initramfs archive assembled in
#       DIR (the caller's temporary directory). In the VM, zebu-csi serves
#       `--node --attach iscsi` on TCP port 50051, forwarded from host 127.0.0.1:GRPC_PORT;
#       a shell service on port 2323 (from 127.0.0.1:SHELL_PORT) runs what the test sends.
#
# The network is QEMU's user-mode stack with restrict=on: the guest reaches nothing but the
# forwards below, all on the host's loopback. The engine's portal (IP:PORT, a host loopback
# address) is what its discovery answers as the TargetAddress; inside the VM a forwarder
# listens on that port, so the guest's connections to IP:PORT go to 10.0.2.100:PORT, which
# QEMU's guestfwd connects to IP:PORT on the host. iscsiadm therefore logs in to exactly the
# portal and target the controller published, unchanged.
set -euo pipefail

CACHE_ROOT=${ZEBU_TOOLS_CACHE:-/var/cache/zebu-tools}
SELF=$(readlink -f "$0")
log() { echo "[node-vm] $*" >&2; }
die() { log "error: $*"; exit 2; }

PKGS=(qemu-system-x86 busybox-static open-iscsi e2fsprogs util-linux mount cpio kmod binutils)
ensure_packages() {
  local missing=()
  for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    [ "$(id -u)" = 0 ] || die "missing packages ${missing[*]} (run as root)"
    log "installing ${missing[*]}"
    apt-get -o DPkg::Lock::Timeout=600 update -qq
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
      --no-install-recommends "${missing[@]}" >/dev/null
  fi
}

kernel_package() {
  local k
  k=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
  if [ -z "$k" ]; then
    apt-get -o DPkg::Lock::Timeout=600 update -qq
    k=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
  fi
  [ -n "$k" ] || die "cannot resolve linux-image-amd64"
  echo "$k"
}

cache_dir() {
  local kpkg iscsi_ver sum
  kpkg=$(kernel_package)
  iscsi_ver=$(dpkg-query -W -f='${Version}' open-iscsi)
  sum=$(sha256sum "$SELF" | cut -c1-12)
  echo "$CACHE_ROOT/vm-iscsi-${kpkg#linux-image-}-open-iscsi-${iscsi_ver}-$sum"
}

# Copy a program and every shared library it needs into the tree $1 at /opt/bin.
copy_program() {
  local root=$1 bin=$2 lib
  cp -L "$bin" "$root/opt/bin/"
  for lib in $(ldd "$bin" | grep -o '/[^ ]*'); do
    mkdir -p "$root$(dirname "$lib")"
    cp -Ln "$lib" "$root$lib"
  done
}

build() {
  ensure_packages
  local dir kpkg kver root
  dir=$(cache_dir)
  if [ -f "$dir/ready" ]; then echo "$dir"; return; fi
  kpkg=$(kernel_package); kver=${kpkg#linux-image-}
  mkdir -p "$CACHE_ROOT"
  work=$(mktemp -d "$CACHE_ROOT/.vm-iscsi-build.XXXXXX")
  chmod 755 "$work"  # apt-get download writes as _apt
  trap 'rm -rf "$work"' EXIT
  log "downloading $kpkg"
  (cd "$work" && apt-get download "$kpkg" >/dev/null)
  dpkg-deb -x "$work/${kpkg}"_*.deb "$work/k"
  depmod -b "$work/k" "$kver"
  root=$work/root
  mkdir -p "$root"/{bin,sbin,etc/iscsi/ifaces,lib/modules,proc,sys,dev,mnt,tmp,run/lock/iscsi,opt/bin}
  mkdir -p "$root"/var/lib/iscsi/{nodes,send_targets,ifaces,isns,static,slp} "$root/var/lock"
  cp /bin/busybox "$root/bin/busybox"
  : > "$root/lib/modules/load.list"
  local m f b
  for m in virtio_pci virtio_net scsi_mod sd_mod scsi_transport_iscsi libiscsi libiscsi_tcp \
           iscsi_tcp crc32c_generic ext4; do
    for f in $(modprobe -d "$work/k" -S "$kver" --show-depends "$m" | awk '$1=="insmod"{print $2}'); do
      b=$(basename "$f")
      grep -qx "$b" "$root/lib/modules/load.list" && continue
      cp "$f" "$root/lib/modules/"
      echo "$b" >> "$root/lib/modules/load.list"
    done
  done
  for f in /usr/sbin/iscsiadm /usr/sbin/iscsid /usr/sbin/mke2fs /usr/sbin/blkid /usr/bin/mount \
           /usr/bin/umount; do
    [ -x "$f" ] || f=/sbin/$(basename "$f")
    copy_program "$root" "$f"
  done
  ln -s mke2fs "$root/opt/bin/mkfs.ext4"
  # Merged /usr: the loader and libraries are found under /lib and /lib64 too.
  if [ -d "$root/usr/lib" ]; then cp -a "$root/usr/lib/." "$root/lib/"; fi
  [ -e "$root/lib64" ] || ln -s lib "$root/lib64"
  cp /etc/mke2fs.conf "$root/etc/"
  # iscsid serves only root, found by name through the peer's uid.
  echo "root:x:0:0:root:/root:/bin/sh" > "$root/etc/passwd"
  echo "root:x:0:" > "$root/etc/group"
  cp /etc/iscsi/iscsid.conf "$root/etc/iscsi/"
  echo "InitiatorName=iqn.2025-01.io.zebu:vm-node" > "$root/etc/iscsi/initiatorname.iscsi"
  cat > "$root/init" <<'INIT'
#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/opt/bin:/bin:/sbin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
mkdir -p /dev/pts; mount -t devpts devpts /dev/pts
echo 1 > /proc/sys/kernel/printk
arg() { tr ' ' '\n' < /proc/cmdline | sed -n "s/^$1=//p" | tail -1; }
say() { echo "ZEBU-VM $(cut -d' ' -f1 /proc/uptime)s: $*"; }
for m in $(cat /lib/modules/load.list); do insmod /lib/modules/$m 2>/dev/null || true; done
ip link set lo up; ip link set eth0 up
ip addr add 10.0.2.15/24 dev eth0; ip route add default via 10.0.2.2
PORT=$(arg zebu.portal_port)
# The engine's portal address is answered by discovery; this listener makes it reach the host.
nc -ll -p "$PORT" -e nc 10.0.2.100 "$PORT" &
nc -ll -p 2323 -e /bin/sh &
iscsid -f > /tmp/iscsid.log 2>&1 &
say "network and iscsid up"
zebu-csi --endpoint tcp://0.0.0.0:50051 --node --node-id "$(arg zebu.node)" --attach iscsi \
  --state-dir /var/lib/zebu-csi --api http://10.0.2.2:9 > /dev/console 2>&1 &
say "zebu-csi started"
while true; do sleep 3600; done
INIT
  chmod +x "$root/init"
  (cd "$root" && find . | cpio -o -H newc --quiet | gzip -1) > "$work/initrd.gz"
  rm -rf "$dir"; mkdir -p "$dir"
  cp "$work/k/boot/vmlinuz-$kver" "$dir/vmlinuz"
  mv "$work/initrd.gz" "$dir/initrd.gz"
  touch "$dir/ready"
  # Entries of older kernels or of an older version of this script are never used again.
  find "$CACHE_ROOT" -maxdepth 1 -name 'vm-iscsi-*' ! -path "$dir" -exec rm -rf {} +
  log "built $dir"
  echo "$dir"
}

run() {
  local csi="" portal="" grpc="" shell="" console="" workdir="" node=vm-node
  while [ $# -gt 0 ]; do
    case "$1" in
      --csi) csi=$2; shift 2;;
      --portal) portal=$2; shift 2;;
      --grpc-port) grpc=$2; shift 2;;
      --shell-port) shell=$2; shift 2;;
      --console) console=$2; shift 2;;
      --workdir) workdir=$2; shift 2;;
      --node) node=$2; shift 2;;
      *) die "unknown argument $1";;
    esac
  done
  [ -n "$csi" ] && [ -n "$portal" ] && [ -n "$grpc" ] && [ -n "$shell" ] && [ -n "$console" ] \
    && [ -n "$workdir" ] || die "run needs --csi --portal --grpc-port --shell-port --console --workdir"
  local dir host port extra
  dir=$(build)
  host=${portal%:*}; port=${portal##*:}
  case "$host" in 127.*) ;; *) die "the portal $portal is not a loopback address";; esac
  # zebu-csi and its libraries, as a second archive the kernel unpacks over the first.
  extra=$workdir
  mkdir -p "$extra/root/opt/bin"
  objcopy --strip-debug "$csi" "$extra/root/opt/bin/zebu-csi"
  copy_program "$extra/root" "$extra/root/opt/bin/zebu-csi" 2>/dev/null || true
  (cd "$extra/root" && find . | cpio -o -H newc --quiet) > "$extra/csi.cpio"
  # The kernel reads an uncompressed archive after another only at a 4-byte boundary.
  local size
  size=$(stat -c %s "$dir/initrd.gz")
  { cat "$dir/initrd.gz"; head -c $(( (4 - size % 4) % 4 )) /dev/zero; cat "$extra/csi.cpio"; } \
    > "$extra/initrd"
  rm -rf "$extra/root" "$extra/csi.cpio"
  # KVM when a kernel really boots under it (a nested hypervisor may offer /dev/kvm and
  # hang); a working one reaches the panic below in about a second.
  local accel="-accel tcg,thread=multi -cpu max"
  if [ -w /dev/kvm ] && timeout 5 qemu-system-x86_64 -accel kvm -cpu host -m 128 -display none \
       -nodefaults -no-reboot -kernel "$dir/vmlinuz" -append "console=ttyS0 panic=-1 rdinit=/none" \
       -serial file:"$extra/probe.log" >/dev/null 2>&1 </dev/null || true; then
    grep -q "Linux version" "$extra/probe.log" 2>/dev/null && accel="-accel kvm -cpu host"
  fi
  log "booting ($accel), initrd $extra/initrd"
  exec qemu-system-x86_64 $accel -m 1024 -smp 2 -display none -nodefaults -no-reboot \
    -serial file:"$console" -kernel "$dir/vmlinuz" -initrd "$extra/initrd" \
    -append "console=ttyS0 quiet panic=-1 zebu.portal_port=$port zebu.node=$node" \
    -netdev "user,id=n0,restrict=on,guestfwd=tcp:10.0.2.100:$port-cmd:busybox nc $host $port,hostfwd=tcp:127.0.0.1:$grpc-10.0.2.15:50051,hostfwd=tcp:127.0.0.1:$shell-10.0.2.15:2323" \
    -device virtio-net-pci,netdev=n0,romfile= </dev/null
}

case "${1:-}" in
  build) build;;
  run) shift; run "$@";;
  *) sed -n '2,24p' "$SELF"; exit 2;;
esac
