#!/usr/bin/env bash
# A real two-node Slurm cluster on this one machine, for the tests that go through the scheduler:
# munge and slurmctld on the host, and one slurmd per compute node, each in its own network
# namespace with its own address on a private bridge.  Debian's packages (Slurm 22.05); root.
#
#   tools/slurm_cluster.sh up        # install what is missing, start the cluster, wait for both nodes
#   tools/slurm_cluster.sh down      # stop every daemon and job process, remove namespaces and bridge
#   tools/slurm_cluster.sh status    # exit 0 when both nodes answer
#   tools/slurm_cluster.sh can-host  # exit 0 when this machine can host it, else say why (exit 3)
#   tools/slurm_cluster.sh env       # the environment a client needs (SLURM_CONF=...)
#   tools/slurm_cluster.sh lose NODE    # the node fails whole: link cut, then every process in it killed
#   tools/slurm_cluster.sh revive NODE  # link back, slurmd started again (the node returns to service)
#
# `up` is idempotent: a healthy cluster is left as it is; a partial one is torn down and started
# again.  Any step that fails names itself and exits 1; `down` leaves nothing running.
# State (configuration, keys, logs, spool) lives in $MEGARL_SLURM_DIR (default /tmp/megarl-slurm).
#
# Facts this rests on (../shared/notes/slurm-on-one-machine.md): slurmd is started with
# `nsenter --net=` plus `unshare --uts --mount` (not `ip netns exec`, which remounts /sys and makes
# slurmd 22.05's cgroup plugin exit), with the node's hostname and a bind-mounted hosts file that
# names every node, so node names from the job's node list resolve to their addresses.
set -euo pipefail

STATE=${MEGARL_SLURM_DIR:-/tmp/megarl-slurm}
BRIDGE=mrlbr0
NET=10.77.0
HOST_ADDR=$NET.1
NODES=(mrlnode1 mrlnode2)
ADDRS=($NET.11 $NET.12)
PARTITION=megarl

say() { echo "slurm_cluster.sh: $*" >&2; }
fail() { say "step '$1' failed${2:+: $2}"; exit 1; }
step() {  # step NAME CMD...: run CMD, or fail naming the step (with its output)
  local name=$1 out
  shift
  if ! out=$("$@" 2>&1); then
    fail "$name" "$out"
  fi
}

can_host() {
  [ "$(id -u)" = 0 ] || { echo "not root (the cluster needs network namespaces and daemons run as root)"; return 3; }
  command -v ip > /dev/null || { echo "no 'ip' command (iproute2)"; return 3; }
  command -v nsenter > /dev/null && command -v unshare > /dev/null || { echo "no nsenter/unshare (util-linux)"; return 3; }
  if ! ip netns add mrl-probe 2> /dev/null; then
    echo "cannot create a network namespace (ip netns add failed)"
    return 3
  fi
  ip netns del mrl-probe
  if ! command -v slurmctld > /dev/null && ! command -v apt-get > /dev/null; then
    echo "Slurm is not installed and there is no apt-get to install it"
    return 3
  fi
  return 0
}

install() {
  local missing=0 b
  for b in slurmctld slurmd sbatch munged; do command -v "$b" > /dev/null || missing=1; done
  [ "$missing" = 0 ] && return 0
  say "installing slurmctld slurmd slurm-client munge from Debian's packages"
  step "apt-get update" apt-get update -q
  step "apt-get install slurmctld slurmd slurm-client munge" \
    env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge
}

conf() { echo "$STATE/slurm.conf"; }

client() { SLURM_CONF=$(conf) "$@"; }

status() {
  [ -f "$(conf)" ] || return 1
  local states
  states=$(client timeout 10 sinfo -h -N -p "$PARTITION" -o "%N %T" 2> /dev/null) || return 1
  local n
  for n in "${NODES[@]}"; do
    echo "$states" | grep -Eq "^$n (idle|allocated|mixed|completing)" || return 1
  done
}

pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2> /dev/null; }

stop_pid() {  # stop_pid PIDFILE: TERM, then KILL after 10 s
  local f=$1 pid i
  [ -f "$f" ] || return 0
  pid=$(cat "$f")
  if kill -0 "$pid" 2> /dev/null; then
    kill -TERM "$pid" 2> /dev/null || true
    for i in $(seq 1 100); do kill -0 "$pid" 2> /dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2> /dev/null && kill -KILL "$pid" 2> /dev/null || true
  fi
  rm -f "$f"
}

down() {
  local i ns pid
  for i in "${!NODES[@]}"; do
    stop_pid "$STATE/slurmd-${NODES[$i]}.pid"
  done
  stop_pid "$STATE/slurmctld.pid"
  stop_pid "$STATE/munge/munged.pid"
  for i in "${!NODES[@]}"; do
    ns=mrl-${NODES[$i]}
    if ip netns list 2> /dev/null | grep -qw "$ns"; then
      # job processes a dead slurmd left behind (Slurm does not kill them): everything in the namespace
      for pid in $(ip netns pids "$ns" 2> /dev/null); do kill -KILL "$pid" 2> /dev/null || true; done
      ip netns del "$ns" 2> /dev/null || true
    fi
  done
  ip link show "$BRIDGE" > /dev/null 2>&1 && ip link del "$BRIDGE" 2> /dev/null || true
  # slurmd's daemons and their jobs are found by pid file above; anything started from this
  # state directory that escaped them (a pid file lost to a crash) is found by its command line
  pkill -KILL -f -- "-f $(conf)" 2> /dev/null || true
  return 0
}

network() {
  local i ns
  step "bridge $BRIDGE" ip link add "$BRIDGE" type bridge
  step "bridge address $HOST_ADDR/24" ip addr add "$HOST_ADDR/24" dev "$BRIDGE"
  step "bridge up" ip link set "$BRIDGE" up
  for i in "${!NODES[@]}"; do
    ns=mrl-${NODES[$i]}
    step "namespace $ns" ip netns add "$ns"
    step "veth pair for $ns" ip link add "mrlv$i" type veth peer name "mrlp$i"
    step "veth into $ns" ip link set "mrlp$i" netns "$ns"
    step "veth onto $BRIDGE" ip link set "mrlv$i" master "$BRIDGE"
    step "veth up (host side of $ns)" ip link set "mrlv$i" up
    step "address ${ADDRS[$i]} in $ns" ip -n "$ns" addr add "${ADDRS[$i]}/24" dev "mrlp$i"
    step "link up in $ns" ip -n "$ns" link set "mrlp$i" up
    step "loopback up in $ns" ip -n "$ns" link set lo up
  done
}

write_files() {
  local host i
  host=$(hostname)
  mkdir -p "$STATE/ctld" "$STATE/munge" "$STATE/log"
  for i in "${!NODES[@]}"; do mkdir -p "$STATE/spool/${NODES[$i]}"; done
  {
    echo "127.0.0.1 localhost"
    echo "$HOST_ADDR $host"
    for i in "${!NODES[@]}"; do echo "${ADDRS[$i]} ${NODES[$i]}"; done
  } > "$STATE/hosts"
  cat > "$(conf)" << EOF
# written by tools/slurm_cluster.sh: a two-node CPU cluster on one machine
ClusterName=megarl
SlurmctldHost=$host($HOST_ADDR)
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$STATE/munge/munge.socket,cred_expire=10
SlurmUser=root
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
JobRequeue=1
SlurmdTimeout=30
KillWait=10
MinJobAge=600
SchedulerParameters=bf_interval=5,sched_interval=10
EOF
  for i in "${!NODES[@]}"; do
    echo "NodeName=${NODES[$i]} NodeAddr=${ADDRS[$i]} NodeHostname=${NODES[$i]} CPUs=$(nproc) State=UNKNOWN" >> "$(conf)"
  done
  echo "PartitionName=$PARTITION Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP" >> "$(conf)"
}

start_munge() {
  local key=$STATE/munge/munge.key
  [ -f "$key" ] || step "munge key" dd if=/dev/urandom of="$key" bs=1 count=1024
  step "munge file ownership" chown -R munge:munge "$STATE/munge"
  chmod 711 "$STATE/munge"  # munged: the socket's directory must be searchable by all
  chmod 400 "$key"
  step "munged" runuser -u munge -- munged --key-file="$key" --socket="$STATE/munge/munge.socket" \
    --pid-file="$STATE/munge/munged.pid" --log-file="$STATE/munge/munged.log" --seed-file="$STATE/munge/munged.seed"
  step "munge round trip" sh -c "munge -n -S '$STATE/munge/munge.socket' | unmunge -S '$STATE/munge/munge.socket'"
}

start_slurmd() {  # start_slurmd INDEX
  local n=${NODES[$1]} ns=mrl-${NODES[$1]}
  # the node's own hostname and hosts file, in private UTS and mount namespaces
  step "slurmd $n in $ns" nsenter --net="/run/netns/$ns" unshare --uts --mount --propagation private \
    sh -c "hostname '$n' && mount --bind '$STATE/hosts' /etc/hosts && exec slurmd -f '$(conf)' -N '$n'"
}

start_slurm() {
  local i
  step "slurmctld" slurmctld -f "$(conf)"
  for i in "${!NODES[@]}"; do start_slurmd "$i"; done
  for i in $(seq 1 300); do
    status && return 0
    sleep 0.1
  done
  fail "both nodes idle within 30 s" "$(client sinfo -N 2>&1 || true); see $STATE/log"
}

up() {
  if status; then
    say "already up ($(conf))"
    return 0
  fi
  local why
  why=$(can_host) || { say "this machine cannot host the cluster: $why"; exit 3; }
  install
  down
  rm -rf "$STATE"
  mkdir -p "$STATE"
  network
  write_files
  start_munge
  start_slurm
  say "up: nodes ${NODES[*]} (${ADDRS[*]}), partition $PARTITION; export SLURM_CONF=$(conf)"
}

node_index() {  # node_index NAME: its index in NODES, or fail
  local i
  for i in "${!NODES[@]}"; do [ "${NODES[$i]}" = "${1:-}" ] && { echo "$i"; return 0; }; done
  echo "slurm_cluster.sh: no node '${1:-}' (the nodes are ${NODES[*]})" >&2
  exit 2
}

lose() {  # a power loss: nothing the node sends after the link is cut reaches anyone
  local i ns pid
  i=$(node_index "${1:-}")
  ns=mrl-${NODES[$i]}
  step "cut the link of ${NODES[$i]} (mrlv$i down)" ip link set "mrlv$i" down
  for pid in $(ip netns pids "$ns" 2> /dev/null); do kill -KILL "$pid" 2> /dev/null || true; done
  rm -f "$STATE/slurmd-${NODES[$i]}.pid"
  say "lost ${NODES[$i]}: link cut, every process in $ns killed"
}

revive() {
  local i
  i=$(node_index "${1:-}")
  step "restore the link of ${NODES[$i]} (mrlv$i up)" ip link set "mrlv$i" up
  pid_alive "$STATE/slurmd-${NODES[$i]}.pid" || start_slurmd "$i"
  say "revived ${NODES[$i]}: link up, slurmd started"
}

case ${1:-} in
  up) up ;;
  down) down ;;
  status) status ;;
  can-host) can_host ;;
  env) echo "SLURM_CONF=$(conf)" ;;
  lose) lose "${2:-}" ;;
  revive) revive "${2:-}" ;;
  *) echo "usage: tools/slurm_cluster.sh up|down|status|can-host|env|lose NODE|revive NODE" >&2; exit 2 ;;
esac
