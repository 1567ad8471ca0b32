#!/usr/bin/env bash
# shardgather-bench reshard on two simulated hosts of three ranks joined by a 1 Gbit/s link,
# checked by check_reshard_bench.py: FSDP sources on ranks 0-1, a TP 2 x 2 engine on ranks 2-5
# (so ranks 3 and 5, both TP rank 1 on host 1, want the same boxes: the fan-out's case). Without
# namespaces `test-hosts probe` skips (77), or fails in CI.
#   reshard_test_hosts.sh NETNS_MPIRUN PYTHON CHECK_SCRIPT JSON BENCH
set -euo pipefail
netns_mpirun=$1 python=$2 check=$3 json=$4 bench=$5
"$(dirname "$netns_mpirun")/test-hosts" probe
export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0"
exec "$python" "$check" "$json" reshard,reshard_flat,reshard_a2aw,gather_bcast,owner_bcast,slice_p2p -- \
  "$netns_mpirun" --hosts 2 --per-host 3 --rate 1gbit -- \
  "$bench" reshard --backend mpi --sources 2 --tp 2 --replicas 2 --model qwen3-moe --layers 1 \
  --iters 2 --mpi-yield --json "$json"
