#!/usr/bin/env bash
# Train on one machine: torchrun --standalone starts one process per device.
#
#   launch/torchrun_single_node.sh --wrapper fsdp --sharding-strategy FULL_SHARD --steps 50
#
# Arguments go to `python -m dpcourse.train` (see --help there). Environment overrides:
#   NPROC_PER_NODE  processes (default: the number of GPUs, else 2 CPU processes on Gloo)
#   MAX_RESTARTS    times torchrun's elastic agent restarts ALL workers after one fails
#                   (default 0); pair it with --checkpoint-every N --resume auto
#   TORCHRUN        the torchrun command (default: torchrun)
#   DRY_RUN=1       print the command instead of running it
set -euo pipefail
TORCHRUN=${TORCHRUN:-torchrun}
MAX_RESTARTS=${MAX_RESTARTS:-0}
if [ -z "${NPROC_PER_NODE:-}" ]; then
  NPROC_PER_NODE=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
  [ "$NPROC_PER_NODE" -gt 0 ] || NPROC_PER_NODE=2
fi
# shellcheck disable=SC2206  # TORCHRUN may be several words, e.g. "python -m torch.distributed.run"
cmd=($TORCHRUN --standalone --nproc_per_node="$NPROC_PER_NODE" --max-restarts="$MAX_RESTARTS"
     -m dpcourse.train "$@")
if [ "${DRY_RUN:-0}" = 1 ]; then
  echo "${cmd[*]}"
  exit 0
fi
exec "${cmd[@]}"
