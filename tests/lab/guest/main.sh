#!/bin/bash
# The storage lab inside the guest (started by the image's init with the checkout mounted at
# $LAB_REPO and the host's output directory at /lab/out).  Steps, each announced on the
# console as "LAB-STEP <name>"; the first failure prints "LAB-FAIL <name>: <why>" and stops.
#
#   modules   nvme, nvme-tcp, nvme-rdma, rdma_rxe, null_blk, sch_netem
#   network   the guest NIC (on a QEMU hub with nothing else on it) 10.77.0.1/24, lo up
#   rxe       soft-RoCE device rxe0 on that NIC
#   target    nvmet, nvmet-tcp, nvmet-rdma; two memory-backed null_blk disks exported by
#             nvmet: one on TCP 10.77.0.1:4420, one on RDMA 10.77.0.1:4421
#   pcie      QEMU's emulated PCIe NVMe drive (serial kvtrace0)
#   prepare   connect both fabrics, ext4 on each of the three namespaces, KV-block files
#             written, everything unmounted and the fabrics disconnected again
#   netem     2 ms delay each way (and 1% loss) on lo, the path of NVMe/TCP in this guest
#   ftrace    a trace instance recording the same NVMe, RDMA CM and TCP tracepoints
#   capture   kvtrace attach on tests/lab/guest/kvlab.py run, which connects, mounts, reads
#   teardown  unmount, disconnect, remove the target
set -Eeuo pipefail
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
OUT=/lab/out
WORK=/lab/work
HERE=$LAB_REPO/tests/lab/guest
PY=${LAB_VENV:-$LAB_REPO/.venv}/bin/python
IP=10.77.0.1
NQN_TCP=nqn.2024-01.io.kvtrace:lab-tcp
NQN_RDMA=nqn.2024-01.io.kvtrace:lab-rdma
BLOCKS=${LAB_BLOCKS:-64}
BLOCK_SIZE=${LAB_BLOCK_SIZE:-262144}
mkdir -p "$WORK" /lab/mnt
: >"$OUT/steps.tsv"

STEP=start
T_STEP=$(date +%s.%N)
step() {
  local t; t=$(date +%s.%N)
  [ "$STEP" = start ] || awk -v s="$STEP" -v a="$t" -v b="$T_STEP" 'BEGIN{printf "%s\t%.1f\n", s, a-b}' >>"$OUT/steps.tsv"
  STEP=$1; T_STEP=$t
  echo "LAB-STEP $1"
}
fail() { echo "LAB-FAIL $STEP: $*"; echo "$STEP: $*" >"$OUT/failed"; exit 1; }
trap 'rc=$?; echo "LAB-FAIL $STEP: command failed (exit $rc) at main.sh line $LINENO: $BASH_COMMAND"; echo "$STEP: exit $rc at line $LINENO: $BASH_COMMAND" >"$OUT/failed"; exit 1' ERR
w() { echo "$2" >"$1"; }   # configfs/sysfs write that fails loudly

step modules
for m in configfs nvme nvme-tcp nvme-rdma rdma_rxe sch_netem; do
  modprobe "$m" || fail "modprobe $m failed (kernel $(uname -r))"
done
modprobe null_blk nr_devices=0 || fail "modprobe null_blk failed"
mountpoint -q /sys/kernel/config || mount -t configfs none /sys/kernel/config
mountpoint -q /sys/kernel/debug || mount -t debugfs debugfs /sys/kernel/debug
mountpoint -q /sys/kernel/tracing || mount -t tracefs tracefs /sys/kernel/tracing
uname -r >"$OUT/kernel"

step network
ip link set lo up
nic=
for n in /sys/class/net/*; do
  n=${n##*/}; [ "$n" = lo ] && continue
  [ "$(cat /sys/class/net/$n/type)" = 1 ] && { nic=$n; break; }
done
[ -n "$nic" ] || fail "no Ethernet interface in the guest"
ip addr add $IP/24 dev "$nic"
ip link set "$nic" up
echo "$nic" >"$OUT/nic"

step rxe
rdma link add rxe0 type rxe netdev "$nic" || fail "rdma link add rxe0 on $nic failed"
for _ in $(seq 50); do [ "$(cat /sys/class/infiniband/rxe0/ports/1/state 2>/dev/null)" = "4: ACTIVE" ] && break; sleep 0.2; done
[ "$(cat /sys/class/infiniband/rxe0/ports/1/state)" = "4: ACTIVE" ] || fail "rxe0 port 1 not ACTIVE"

step target
for m in nvmet nvmet-tcp nvmet-rdma; do
  modprobe "$m" || fail "modprobe $m failed (kernel $(uname -r))"
done
nb=/sys/kernel/config/nullb
for i in 0 1; do
  mkdir $nb/nullb$i
  w $nb/nullb$i/size 256; w $nb/nullb$i/memory_backed 1; w $nb/nullb$i/blocksize 4096
  w $nb/nullb$i/power 1
done
nt=/sys/kernel/config/nvmet
export_ns() {  # nqn backing-device port-id trtype trsvcid
  mkdir "$nt/subsystems/$1"
  w "$nt/subsystems/$1/attr_allow_any_host" 1
  mkdir "$nt/subsystems/$1/namespaces/1"
  w "$nt/subsystems/$1/namespaces/1/device_path" "$2"
  w "$nt/subsystems/$1/namespaces/1/enable" 1
  mkdir "$nt/ports/$3"
  w "$nt/ports/$3/addr_trtype" "$4"; w "$nt/ports/$3/addr_adrfam" ipv4
  w "$nt/ports/$3/addr_traddr" $IP; w "$nt/ports/$3/addr_trsvcid" "$5"
  ln -s "$nt/subsystems/$1" "$nt/ports/$3/subsystems/$1"
}
export_ns $NQN_TCP /dev/nullb0 1 tcp 4420    # a failure names the step and the command
export_ns $NQN_RDMA /dev/nullb1 2 rdma 4421

step pcie
pcie=
for c in /sys/class/nvme/nvme*; do
  [ "$(cat $c/transport)" = pcie ] && [ "$(cat $c/serial | tr -d ' ')" = kvtrace0 ] && pcie=${c##*/}
done
[ -n "$pcie" ] || fail "QEMU's NVMe drive (serial kvtrace0) not found"

step prepare
connect() {  # trtype trsvcid nqn -> prints the controller
  nvme connect -t "$1" -a $IP -s "$2" -n "$3" --keep-alive-tmo 3600 >/dev/null || return 1
  for _ in $(seq 100); do
    for c in /sys/class/nvme/nvme*; do
      if [ "$(cat $c/subsysnqn)" = "$3" ] && [ "$(cat $c/state)" = live ] && ls -d $c/nvme*n1 >/dev/null 2>&1; then
        echo "${c##*/}"; return 0
      fi
    done
    sleep 0.2
  done
  return 1
}
head_disk() {  # controller -> its namespace 1 as mounted (the multipath head when there is one)
  local p; p=$(basename "$(ls -d /sys/class/nvme/$1/nvme*n1 | head -n 1)")
  if [[ $p =~ ^nvme([0-9]+)c[0-9]+n([0-9]+)$ ]]; then echo "nvme${BASH_REMATCH[1]}n${BASH_REMATCH[2]}"; else echo "$p"; fi
}
tcp_ctrl=$(connect tcp 4420 $NQN_TCP) || fail "nvme connect over TCP to $IP:4420 failed"
rdma_ctrl=$(connect rdma 4421 $NQN_RDMA) || fail "nvme connect over RDMA (rxe0) to $IP:4421 failed"
for spec in "pcie:$pcie" "tcp:$tcp_ctrl" "rdma:$rdma_ctrl"; do
  name=${spec%%:*}; ctrl=${spec#*:}
  dev=/dev/$(head_disk "$ctrl")
  for _ in $(seq 50); do [ -b "$dev" ] && break; sleep 0.2; done
  mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 -L "kv-$name" "$dev" || fail "mkfs.ext4 on $dev ($name) failed"
  mkdir -p /lab/mnt/$name
  mount "$dev" /lab/mnt/$name
  python3 "$HERE/kvlab.py" write --dir /lab/mnt/$name --ns "$name" --blocks "$BLOCKS" --block-size "$BLOCK_SIZE" \
    --manifest "$WORK/$name.manifest.json" || fail "writing KV blocks on $dev ($name) failed"
  umount /lab/mnt/$name
  echo "  $name: $ctrl $dev, $BLOCKS blocks of $BLOCK_SIZE bytes"
done
nvme disconnect -n $NQN_TCP >/dev/null || fail "nvme disconnect $NQN_TCP failed"
nvme disconnect -n $NQN_RDMA >/dev/null || fail "nvme disconnect $NQN_RDMA failed"
sleep 1
cat >"$WORK/config.json" <<EOF
{"namespaces": {
  "pcie": {"transport": "pcie", "ctrl": "$pcie", "manifest": "$WORK/pcie.manifest.json"},
  "tcp":  {"transport": "tcp",  "traddr": "$IP", "trsvcid": 4420, "nqn": "$NQN_TCP", "manifest": "$WORK/tcp.manifest.json"},
  "rdma": {"transport": "rdma", "traddr": "$IP", "trsvcid": 4421, "nqn": "$NQN_RDMA", "manifest": "$WORK/rdma.manifest.json"}
 },
 "modes": ["direct", "buffered"], "tcp_delay_ms": ${LAB_TCP_DELAY_MS:-2}, "tcp_loss_pct": ${LAB_TCP_LOSS_PCT:-1}}
EOF
cp "$WORK/config.json" "$OUT/config.json"

step netem
tc qdisc add dev lo root netem delay ${LAB_TCP_DELAY_MS:-2}ms loss ${LAB_TCP_LOSS_PCT:-1}% \
  || fail "tc netem on lo failed"
tc qdisc show dev lo >"$OUT/netem"

step ftrace
# The kernel's own record of the same tracepoints, in a trace instance of its own, on
# CLOCK_MONOTONIC: every NVMe command set up and completed (per controller and queue), every
# RDMA CM event, every TCP retransmission.  The host compares kvtrace's tables with it.
ti=/sys/kernel/tracing/instances/kvlab
mkdir "$ti"
w "$ti/buffer_size_kb" 16384
w "$ti/trace_clock" mono
for e in nvme/nvme_setup_cmd nvme/nvme_complete_rq rdma_cma/cm_event_handler tcp/tcp_retransmit_skb; do
  w "$ti/events/$e/enable" 1
done
w "$ti/tracing_on" 1

step capture
opts=(--quiet --out "$OUT/ds")
help=$("$PY" -m kvtrace attach --help 2>&1) || fail "kvtrace cannot start in the guest: $help"
grep -q -- --nvme-events <<<"$help" && opts+=(--nvme-events all)
"$PY" -m kvtrace doctor --json >"$OUT/doctor.json" 2>"$OUT/doctor.stderr" || true
rc=0
"$PY" -m kvtrace attach "${opts[@]}" -- /usr/bin/python3 "$HERE/kvlab.py" run \
  --config "$WORK/config.json" --result "$OUT/reader.json" 2> >(tee "$OUT/attach.stderr" >&2) || rc=$?
echo "$rc" >"$OUT/attach.rc"
w "$ti/tracing_on" 0
cat "$ti/trace" >"$OUT/ftrace.txt"
grep -H overrun "$ti"/per_cpu/cpu*/stats >"$OUT/ftrace.overrun"
# the instance's removal has been seen to hang the guest's kernel (6.1 under TCG) after a
# capture; the guest is thrown away, so it is tried in the background and never waited for
( trap - ERR; set +e; echo 0 >"$ti/events/enable"; rmdir "$ti" ) >/dev/null 2>&1 &
# kvtrace's own failures are the tests' to report (tests/lab/test_lab.py); the lab goes on
[ "$rc" = 0 ] || echo "kvtrace attach exited $rc: $(grep -v '^ ' "$OUT/attach.stderr" | tail -n 1)"

step teardown   # bounded: a stuck unmount or disconnect must not keep the results from the host
timeout 30 tc qdisc del dev lo root 2>/dev/null || true
for m in /lab/mnt/*; do mountpoint -q "$m" && { timeout 30 umount "$m" || true; }; done
timeout 30 nvme disconnect -n $NQN_TCP >/dev/null 2>&1 || true
timeout 30 nvme disconnect -n $NQN_RDMA >/dev/null 2>&1 || true
step done
echo ok >"$OUT/ok"
