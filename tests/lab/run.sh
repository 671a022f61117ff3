#!/usr/bin/env bash
# Boot the storage lab's guest (built by tests/lab/build.sh) under QEMU and run the guest
# side (tests/lab/guest/main.sh) to the end.  The checkout is shared into the guest
# read-only over 9p at its own path (so its venv works there as here); OUT is shared
# read-write and receives the guest's results: the kvtrace dataset (ds/), the reader's
# record of the kernel's own accounting (reader.json), the console log, and timings.json.
#
#   tests/lab/run.sh --out OUT [--accel auto|kvm|tcg] [--timeout S] [--boot-timeout S] [--keep]
#
# Exit 0 when the guest finished every step.  Otherwise one line names the step that failed
# (a host step: check, boot; or a guest step from main.sh) and why, and nothing is left
# behind: the QEMU process started here is stopped, its scratch files removed, and no image
# is ever mounted on the host.
#
# Environment: KVTRACE_LAB_CACHE (image cache, default /var/cache/kvtrace/lab),
# KVTRACE_VENV (the venv kvtrace runs from in the guest, default <checkout>/.venv),
# KVTRACE_LAB_ACCEL (default auto: KVM when it boots the kernel within
# KVTRACE_LAB_KVM_PROBE seconds, default 20, else TCG), KVTRACE_LAB_BOOT_TIMEOUT (180 s) and
# KVTRACE_LAB_BOOT_TRIES (2: a guest that has not reached its lab script in time is booted again), KVTRACE_LAB_MULTIPATH (nvme_core
# native multipath, Y as Debian ships it), KVTRACE_LAB_SMP (2), KVTRACE_LAB_MEM (4096 MiB),
# KVTRACE_LAB_APPEND (more kernel command line), KVTRACE_LAB_QEMU (the QEMU binary),
# LAB_BLOCKS, LAB_BLOCK_SIZE, LAB_TCP_DELAY_MS, LAB_TCP_LOSS_PCT (passed to the guest).
set -Eeuo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
cache=${KVTRACE_LAB_CACHE:-/var/cache/kvtrace/lab}
img=$cache/image
venv=${KVTRACE_VENV:-$repo/.venv}
accel=${KVTRACE_LAB_ACCEL:-auto}
kvm_probe=${KVTRACE_LAB_KVM_PROBE:-20}
timeout=${KVTRACE_LAB_TIMEOUT:-1500}
boot_timeout=${KVTRACE_LAB_BOOT_TIMEOUT:-180}
boot_tries=${KVTRACE_LAB_BOOT_TRIES:-2}
out= keep=0
while [ $# -gt 0 ]; do
  case $1 in
    --out) out=$2; shift 2 ;;
    --accel) accel=$2; shift 2 ;;
    --timeout) timeout=$2; shift 2 ;;
    --boot-timeout) boot_timeout=$2; shift 2 ;;
    --keep) keep=1; shift ;;
    *) echo "usage: $0 --out OUT [--accel auto|kvm|tcg] [--timeout S] [--boot-timeout S] [--keep]" >&2; exit 2 ;;
  esac
done

step=check
qemu_pid= work=
say() { echo "lab run: $*" >&2; }
fail() { say "FAILED at step '$step': $*"; exit 1; }
cleanup() {
  local rc=$?
  if [ -n "$qemu_pid" ] && kill -0 "$qemu_pid" 2>/dev/null; then
    kill "$qemu_pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$qemu_pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$qemu_pid" 2>/dev/null || true
    wait "$qemu_pid" 2>/dev/null || true
  fi
  if [ -n "$work" ] && [ -d "$work" ]; then
    if [ $keep = 1 ]; then say "scratch kept in $work"; else rm -rf "$work"; fi
  fi
  exit $rc
}
trap cleanup EXIT
trap 'say "FAILED at step '"'"'$step'"'"' (exit $?, run.sh line $LINENO: $BASH_COMMAND)"' ERR
trap 'step=interrupted; exit 130' INT TERM

[ -n "$out" ] || fail "--out OUT is required"
qemu=${KVTRACE_LAB_QEMU:-qemu-system-x86_64}
command -v "$qemu" >/dev/null || fail "$qemu missing (tests/lab/build.sh installs qemu-system-x86)"
for f in rootfs.img vmlinuz initrd.img kernel-release; do
  [ -s "$img/$f" ] || fail "no $img/$f: build the image first (tests/lab/build.sh)"
done
[ -x "$venv/bin/python" ] || fail "no venv at $venv (scripts/setup-host makes it)"
if [ -e "$out" ] && [ -n "$(ls -A "$out" 2>/dev/null)" ]; then fail "--out $out exists and is not empty"; fi
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/kvtrace-lab.XXXXXX")
truncate -s 512M "$work/nvme.img"

krel=$(cat "$img/kernel-release")
append="root=/dev/vda rw console=ttyS0 init=/sbin/kvtrace-lab-init panic=-1 mitigations=off"
append+=" nvme_core.multipath=${KVTRACE_LAB_MULTIPATH:-Y} LAB_REPO=$repo LAB_VENV=$venv"
[ -n "${KVTRACE_LAB_APPEND:-}" ] && append+=" $KVTRACE_LAB_APPEND"
for v in LAB_BLOCKS LAB_BLOCK_SIZE LAB_TCP_DELAY_MS LAB_TCP_LOSS_PCT; do
  [ -n "${!v:-}" ] && append+=" $v=${!v}"
done
shares=(-virtfs "local,path=$repo,mount_tag=repo,security_model=none,readonly=on"
        -virtfs "local,path=$out,mount_tag=out,security_model=none")
case "$venv/" in
  "$repo"/*) ;;
  *) shares+=(-virtfs "local,path=$venv,mount_tag=venv,security_model=none,readonly=on") ;;
esac

start_qemu() {  # accel-args...
  : >"$out/console.log"
  # setpriv --pdeathsig: QEMU gets SIGTERM if this script dies, even by SIGKILL
  TMPDIR=$work setpriv --pdeathsig TERM -- "$qemu" -nodefaults -no-user-config -machine q35 "$@" \
    -smp "${KVTRACE_LAB_SMP:-2}" -m "${KVTRACE_LAB_MEM:-4096}" \
    -display none -monitor none -serial "file:$out/console.log" -no-reboot \
    -kernel "$img/vmlinuz" -initrd "$img/initrd.img" -append "$append" \
    -drive "file=$img/rootfs.img,if=virtio,format=raw,snapshot=on" \
    -drive "file=$work/nvme.img,if=none,id=nv0,format=raw" -device nvme,serial=kvtrace0,drive=nv0 \
    -netdev hubport,id=n0,hubid=0 -device virtio-net-pci,netdev=n0 \
    "${shares[@]}" >"$work/qemu.out" 2>&1 &
  qemu_pid=$!
}
stop_qemu() {
  kill "$qemu_pid" 2>/dev/null || true
  wait "$qemu_pid" 2>/dev/null || true
  qemu_pid=
}
con() { tr -d '\r' <"$out/console.log" 2>/dev/null; }

step=boot
t0=$(date +%s.%N)
used=
if [ "$accel" != tcg ] && [ -w /dev/kvm ]; then
  start_qemu -accel kvm -cpu host
  for _ in $(seq "$kvm_probe"); do
    sleep 1
    con | grep -q "Linux version" && { used=kvm; break; }
    kill -0 "$qemu_pid" 2>/dev/null || break
  done
  if [ -z "$used" ]; then
    stop_qemu
    [ "$accel" = kvm ] && fail "KVM did not boot the kernel within ${kvm_probe}s ($(tail -c 300 "$work/qemu.out" | tr '\n' ' '))"
    say "KVM did not boot the kernel within ${kvm_probe}s; using TCG"
  fi
elif [ "$accel" = kvm ]; then
  fail "/dev/kvm is not usable"
fi
if [ -z "$used" ]; then
  start_qemu -accel tcg,thread=multi -cpu max
  used=tcg
fi
accel_args=(-accel kvm -cpu host)
[ "$used" = tcg ] && accel_args=(-accel tcg,thread=multi -cpu max)
say "QEMU ($used, pid $qemu_pid) booting Debian $krel; console: $out/console.log"

t_boot= t_end= last=
deadline=$(( $(date +%s) + timeout ))
boot_deadline=$(( $(date +%s) + boot_timeout ))
while kill -0 "$qemu_pid" 2>/dev/null; do
  sleep 1
  cur=$(con | grep -a -o '^LAB-STEP [a-z-]*' | tail -n 1 | cut -d' ' -f2 || true)
  if [ -n "$cur" ] && [ -z "$t_boot" ]; then
    t_boot=$(date +%s.%N)
    say "guest up after $(awk -v a="$t_boot" -v b="$t0" 'BEGIN{printf "%.0f", a-b}')s"
  fi
  if [ -n "$cur" ] && [ "$cur" != "$last" ]; then say "guest step $cur"; last=$cur; step=$cur; fi
  con | grep -a -q '^LAB-EXIT' && { t_end=$(date +%s.%N); break; }
  if [ -z "$t_boot" ] && [ "$(date +%s)" -gt "$boot_deadline" ]; then
    con | grep -a -q '^LAB-FAIL init' && fail "$(con | grep -a '^LAB-FAIL init' | head -n 1)"
    if [ "$boot_tries" -gt 1 ]; then   # a guest kernel that stalls in early boot (seen under TCG): once more
      boot_tries=$((boot_tries - 1))
      stop_qemu
      cp "$out/console.log" "$out/console.stalled.log"
      say "the guest did not reach its lab script within ${boot_timeout}s (console: $out/console.stalled.log); booting it again"
      start_qemu "${accel_args[@]}"
      boot_deadline=$(( $(date +%s) + boot_timeout ))
      continue
    fi
    fail "boot timeout: the guest did not reach its lab script within ${boot_timeout}s (console: $out/console.log)"
  fi
  [ "$(date +%s)" -gt "$deadline" ] && fail "timeout: the lab did not finish within ${timeout}s"
done
[ -n "$t_end" ] || t_end=$(date +%s.%N)
# the guest powers itself off after LAB-EXIT; give it a moment, then stop it
for _ in $(seq 30); do kill -0 "$qemu_pid" 2>/dev/null || break; sleep 1; done
stop_qemu

awk -v acc="$used" -v t0="$t0" -v tb="${t_boot:-$t_end}" -v te="$t_end" -v k="$krel" 'BEGIN{
  printf "{\"accel\": \"%s\", \"kernel\": \"%s\", \"boot_s\": %.1f, \"guest_s\": %.1f, \"total_s\": %.1f, \"steps\": {", acc, k, tb-t0, te-tb, te-t0 }' >"$out/timings.json"
if [ -s "$out/steps.tsv" ]; then
  awk -F'\t' 'BEGIN{s=""} {printf "%s\"%s\": %s", s, $1, $2; s=", "}' "$out/steps.tsv" >>"$out/timings.json"
fi
echo "}}" >>"$out/timings.json"

if [ -e "$out/ok" ]; then
  say "done: boot $(awk -v a="${t_boot:-$t_end}" -v b="$t0" 'BEGIN{printf "%.0f", a-b}')s, guest $(awk -v a="$t_end" -v b="${t_boot:-$t_end}" 'BEGIN{printf "%.0f", a-b}')s ($used); results in $out"
  exit 0
fi
if [ -s "$out/failed" ]; then
  f=$(cat "$out/failed"); step=${f%%: *}
  fail "${f#*: }"
fi
msg=$(con | grep -a '^LAB-FAIL' | head -n 1 || true)
[ -n "$msg" ] && fail "$msg"
[ -n "$t_boot" ] || { step=boot; fail "the guest stopped before reaching its lab script (console: $out/console.log: $(con | grep -a -i -m1 -E 'panic|error' || true))"; }
fail "the guest stopped without finishing ($(con | grep -a -B1 '^LAB-EXIT' | head -n 1); console: $out/console.log)"
