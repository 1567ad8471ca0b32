#!/usr/bin/env bash
# shardgather-bench --ops overlap on two simulated hosts joined by a 1 Gbit/s link, checked by
# check_bench_output.py. Without namespaces `test-hosts probe` skips (77), or fails in CI.
#   overlap_test_hosts.sh NETNS_MPIRUN PYTHON CHECK_SCRIPT JSON BENCH
set -euo pipefail
netns_mpirun=$1 python=$2 check=$3 json=$4 bench=$5
"$(dirname "$netns_mpirun")/test-hosts" probe
# Under the ASan preset: Open MPI's plugins leak at exit (RELIABILITY E13), as the other MPI
# tests say through MPIEXEC_PREFLAGS; the ranks inherit this environment (ignored without ASan).
export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0"
exec "$python" "$check" "$json" -- "$netns_mpirun" --hosts 2 --per-host 1 --rate 1gbit -- \
  "$bench" --backend mpi --preset tiny-1000 --ops limit,overlap --iters 3 --warmup 1 --json "$json"
