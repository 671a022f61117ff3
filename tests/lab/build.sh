#!/usr/bin/env bash
# Build (or reuse) the storage lab's guest: Debian's own kernel (linux-image-amd64, 6.1, with
# nvme, nvme-tcp, nvme-rdma, nvmet, nvmet-tcp, nvmet-rdma, rdma_rxe, null_blk as modules) and
# a root filesystem made by debootstrap holding python3-bpfcc, that kernel's headers, nvme-cli,
# rdma-core and iproute2.  Debian packages only; nothing of kvtrace is baked in (the guest
# mounts the checkout over 9p at boot).
#
#   tests/lab/build.sh            build unless the cached image matches this script
#   tests/lab/build.sh --force    rebuild
#
# Output (KVTRACE_LAB_CACHE, default /var/cache/kvtrace/lab):
#   image/rootfs.img  image/vmlinuz  image/initrd.img  image/kernel-release  image/stamp
#   debs/             downloaded .debs, reused by the next build
# No image is ever mounted: the ext4 image is written from a directory with mke2fs -d.
set -Eeuo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cache=${KVTRACE_LAB_CACHE:-/var/cache/kvtrace/lab}
mirror=${KVTRACE_LAB_MIRROR:-http://deb.debian.org/debian}
suite=${KVTRACE_LAB_SUITE:-bookworm}
img_size=${KVTRACE_LAB_ROOTFS_SIZE:-6G}
force=0
[ "${1:-}" = "--force" ] && force=1

# Guest packages.  Recommends are not installed (debootstrap resolves Depends only).
packages=(
  linux-image-amd64 linux-headers-amd64 initramfs-tools kmod
  python3 python3-bpfcc
  nvme-cli rdma-core ibverbs-utils librdmacm1 rdmacm-utils iproute2
  e2fsprogs util-linux procps iputils-ping
)

step=start
fail() { echo "lab build: FAILED at step '$step': $*" >&2; exit 1; }
on_err() { echo "lab build: FAILED at step '$step' (exit $1, line $2)" >&2; }
trap 'on_err $? $LINENO' ERR

build=$cache/build
root=$build/rootfs
cleanup_mounts() {
  # debootstrap mounts /proc and /sys in the target while it installs; a failure can leave
  # them behind.  Unmount everything under the build tree, deepest first.
  [ -d "$root" ] || return 0
  local m
  for m in $(findmnt -rn -o TARGET | { grep -F "$root" || true; } | sort -r); do
    umount -l "$m" 2>/dev/null || true
  done
}
trap 'cleanup_mounts' EXIT

step=host-tools
[ "$(id -u)" = 0 ] || fail "needs root (debootstrap, chroot)"
# The host side of the lab, from Debian: QEMU (TCG or KVM), debootstrap, mke2fs.
host_pkgs=(qemu-system-x86 qemu-utils debootstrap e2fsprogs)
missing=()
for p in "${host_pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "lab build: installing ${missing[*]}"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"; } \
    >"${TMPDIR:-/tmp}/kvtrace-lab-apt.log" 2>&1 || { tail -n 20 "${TMPDIR:-/tmp}/kvtrace-lab-apt.log" >&2; fail "apt-get install ${missing[*]} failed"; }
fi
for t in debootstrap mke2fs chroot sha256sum qemu-system-x86_64; do
  command -v "$t" >/dev/null || fail "missing $t"
done

# The stamp names everything the image depends on: the package list, the guest's init, the
# mirror/suite/size and the layout version (bump it when the configure step changes).
layout=1
stamp=$( { echo "layout $layout ${packages[*]} $mirror $suite $img_size"; cat "$here/guest/init"; } | sha256sum | cut -d' ' -f1)
if [ $force = 0 ] && [ -f "$cache/image/stamp" ] && [ "$(cat "$cache/image/stamp")" = "$stamp" ] \
   && [ -s "$cache/image/rootfs.img" ] && [ -s "$cache/image/vmlinuz" ] && [ -s "$cache/image/initrd.img" ]; then
  echo "lab build: cached image is current ($cache/image, kernel $(cat "$cache/image/kernel-release"))"
  exit 0
fi

t0=$(date +%s)
step=debootstrap
mkdir -p "$cache/debs" "$cache/image"
cleanup_mounts
if [ "${KVTRACE_LAB_REUSE_ROOTFS:-0}" = 1 ] && [ -f "$build/debootstrap.ok" ]; then
  echo "lab build: reusing the debootstrapped tree in $build (KVTRACE_LAB_REUSE_ROOTFS=1)"
else
rm -rf "$build"
mkdir -p "$build"
echo "lab build: debootstrap $suite from $mirror (${#packages[@]} packages + dependencies)"
include=$(IFS=,; echo "${packages[*]}")
if ! debootstrap --variant=minbase --include="$include" --cache-dir="$cache/debs" \
      "$suite" "$root" "$mirror" >"$build/debootstrap.log" 2>&1; then
  tail -n 30 "$build/debootstrap.log" >&2
  [ -f "$root/debootstrap/debootstrap.log" ] && tail -n 30 "$root/debootstrap/debootstrap.log" >&2
  fail "debootstrap did not finish (log: $build/debootstrap.log)"
fi
cleanup_mounts
touch "$build/debootstrap.ok"
echo "lab build: debootstrap done in $(( $(date +%s) - t0 ))s"
fi

step=kernel
krel=$(ls "$root/lib/modules" | sort -V | tail -n 1)
[ -n "$krel" ] || fail "no kernel under $root/lib/modules"
for m in nvme nvme-core nvme-fabrics nvme-tcp nvme-rdma nvmet nvmet-tcp nvmet-rdma rdma_rxe null_blk \
         rdma_cm ib_core 9p 9pnet_virtio; do
  f=$(find "$root/lib/modules/$krel" -name "${m}.ko*" -o -name "${m//-/_}.ko*" | head -n 1)
  [ -n "$f" ] || fail "kernel $krel has no module $m"
done
[ -e "$root/usr/src/linux-headers-$krel/Makefile" ] || fail "no headers for $krel (linux-headers-amd64)"
[ -s "$root/boot/vmlinuz-$krel" ] || fail "no /boot/vmlinuz-$krel"
if [ ! -s "$root/boot/initrd.img-$krel" ]; then
  chroot "$root" update-initramfs -c -k "$krel" >"$build/initramfs.log" 2>&1 \
    || { tail -n 20 "$build/initramfs.log" >&2; fail "update-initramfs failed"; }
fi

step=configure
echo kvtrace-lab >"$root/etc/hostname"
printf '127.0.0.1 localhost\n127.0.1.1 kvtrace-lab\n' >"$root/etc/hosts"
: >"$root/etc/fstab"
mkdir -p "$root/etc/nvme"
echo "nqn.2014-08.org.nvmexpress:uuid:6b9a3f4e-6f43-4bd4-8d4b-6c1b0a6b2e01" >"$root/etc/nvme/hostnqn"
echo "6b9a3f4e-6f43-4bd4-8d4b-6c1b0a6b2e01" >"$root/etc/nvme/hostid"
install -m 755 "$here/guest/init" "$root/sbin/kvtrace-lab-init"
chroot "$root" apt-get clean >/dev/null 2>&1 || true
rm -rf "$root/var/lib/apt/lists/"* "$root/debootstrap"

step=image
cp "$root/boot/vmlinuz-$krel" "$cache/image/vmlinuz.new"
cp "$root/boot/initrd.img-$krel" "$cache/image/initrd.img.new"
rm -f "$cache/image/rootfs.img.new"
cleanup_mounts
left=$(findmnt -rn -o TARGET | { grep -F "$root/" || true; })
[ -z "$left" ] || fail "still mounted under the root tree: $left"
mke2fs -q -t ext4 -L kvtrace-lab -E lazy_itable_init=0,lazy_journal_init=0 \
  -d "$root" "$cache/image/rootfs.img.new" "$img_size" >"$build/mke2fs.log" 2>&1 \
  || fail "mke2fs -d could not write the image: $(tail -n 2 "$build/mke2fs.log" | tr '\n' ' ')"
for f in rootfs.img vmlinuz initrd.img; do mv -f "$cache/image/$f.new" "$cache/image/$f"; done
echo "$krel" >"$cache/image/kernel-release"
echo "$stamp" >"$cache/image/stamp"
du -sh "$root" | awk '{print "lab build: rootfs " $1}'
rm -rf "$build"
echo "lab build: image ready in $(( $(date +%s) - t0 ))s ($cache/image, kernel $krel)"
