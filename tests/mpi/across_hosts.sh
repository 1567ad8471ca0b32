#!/usr/bin/env bash
# The MPI suite across simulated hosts: tools/netns-mpirun --hosts 2 --per-host 2 -- PROGRAM.
# Where namespaces cannot be made (not root, or a chroot that refuses them) `test-hosts probe`
# exits 77 (skipped), or 1 under SHARDGATHER_REQUIRE_TEST_HOSTS=1 (CI); any other failure fails.
#   across_hosts.sh NETNS_MPIRUN PROGRAM
set -euo pipefail
"$(dirname "$1")/test-hosts" probe
exec "$1" --hosts 2 --per-host 2 -- "$2"
