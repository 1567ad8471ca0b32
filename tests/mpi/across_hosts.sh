#!/usr/bin/env bash
# The MPI suite across simulated hosts: tools/netns-mpirun --hosts 2 --per-host 2 -- PROGRAM.
# Exit 77 (skipped) where namespaces cannot be made (not root, or a chroot that refuses them),
# with the same probe as tests/bench/overlap_test_hosts.sh; any other failure fails.
#   across_hosts.sh NETNS_MPIRUN PROGRAM
set -euo pipefail
if [ "$(id -u)" != 0 ] || ! command -v ip >/dev/null || ! command -v nsenter >/dev/null ||
  ! unshare --net --uts --mount true 2>/dev/null; then
  echo "skipped: simulated hosts need root, ip, nsenter and namespaces"
  exit 77
fi
exec "$1" --hosts 2 --per-host 2 -- "$2"
