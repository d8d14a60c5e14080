#!/usr/bin/env bash
# Train across machines: run this same command on EVERY node; torchrun's c10d rendezvous
# (a store on RDZV_ENDPOINT) lets the nodes find each other and assigns the ranks.
#
#   NNODES=2 NPROC_PER_NODE=8 RDZV_ENDPOINT=node001:29500 launch/torchrun_multi_node.sh --wrapper fsdp
#
# Environment:
#   NNODES          number of nodes (required)
#   RDZV_ENDPOINT   host:port on one of the nodes, reachable from all (required)
#   NPROC_PER_NODE  processes per node (default: the number of GPUs, else 2)
#   RDZV_ID         job id shared by the nodes (default: dpcourse)
#   MAX_RESTARTS    times the agents restart ALL workers after one fails (default 0);
#                   pair it with --checkpoint-every N --resume auto
#   TORCHRUN        the torchrun command (default: torchrun)
#   DRY_RUN=1       print the command instead of running it
# With c10d, torchrun ignores --node_rank: ranks are assigned at rendezvous.
# NCCL hints for real clusters: NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME pick the network
# interface (e.g. ib0, eth0); NCCL_IB_HCA the InfiniBand adapters; NCCL_DEBUG=INFO logs
# which transport NCCL chose (look for "NET/IB" vs "NET/Socket").
set -euo pipefail
: "${NNODES:?set NNODES to the number of nodes}"
: "${RDZV_ENDPOINT:?set RDZV_ENDPOINT to host:port of one node, e.g. node001:29500}"
TORCHRUN=${TORCHRUN:-torchrun}
RDZV_ID=${RDZV_ID:-dpcourse}
MAX_RESTARTS=${MAX_RESTARTS:-0}
if [ -z "${NPROC_PER_NODE:-}" ]; then
  NPROC_PER_NODE=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
  [ "$NPROC_PER_NODE" -gt 0 ] || NPROC_PER_NODE=2
fi
# shellcheck disable=SC2206
cmd=($TORCHRUN --nnodes="$NNODES" --nproc_per_node="$NPROC_PER_NODE" --rdzv_backend=c10d
     --rdzv_endpoint="$RDZV_ENDPOINT" --rdzv_id="$RDZV_ID" --max-restarts="$MAX_RESTARTS"
     -m dpcourse.train "$@")
if [ "${DRY_RUN:-0}" = 1 ]; then
  echo "${cmd[*]}"
  exit 0
fi
exec "${cmd[@]}"
