#!/usr/bin/env bash
# tools/test-hosts: hosts left over by a run that was killed do not block the next run, and
# hosts whose caller still runs are never taken from it.
#   test_hosts_left_over.sh TOOLS_DIR
# Needs root and namespaces: `test-hosts probe` skips (77), or fails in CI. Ends with
# `N passed, M failed`.
set -uo pipefail
T=$1/test-hosts
"$T" probe || exit $?
STATE=/run/shardgather-test-hosts
passed=0 failed=0
check() {  # check NAME EXPECTED ACTUAL
  if [ "$2" = "$3" ]; then
    passed=$((passed + 1)) && echo "ok   $1"
  else
    failed=$((failed + 1)) && echo "FAIL $1: expected $2, got $3"
  fi
}
# Brings 2 hosts up from a caller that is then SIGKILLed, as a CI timeout would.
up_and_die() { (bash -c "'$T' up 2 2>/dev/null; kill -9 \$\$") 2>/dev/null; }
up_rc() { local rc=0; "$T" up 2 2>>"$log" || rc=$?; echo "$rc"; }
log=$(mktemp)
# Hosts up for someone else's job: not ours to take down.
if [ "$(up_rc)" = 3 ]; then
  echo "skipped: test hosts are up and may be in use: $(cat "$log")"
  exit 77
fi
trap '"$T" down; rm -f "$log"' EXIT
"$T" down

up_and_die
check "a killed caller's hosts are taken down by the next up" 0 "$(up_rc)"
grep -q "left over from a run that is gone" "$log"
check "  ... which says so" 0 $?
"$T" down

# A caller still running: its hosts stay, with their holders.
bash -c "'$T' up 2 2>/dev/null; sleep 60" &
owner=$!
for _ in $(seq 100); do [ -e "$STATE/h1.netns" ] && break; sleep 0.1; done
holders=$(pgrep -f shardgather-test-host-sg-h | sort | tr '\n' ' ')
check "a running caller's hosts are refused (exit 3)" 3 "$(up_rc)"
check "  ... and left as they were" "$holders" "$(pgrep -f shardgather-test-host-sg-h | sort | tr '\n' ' ')"
kill "$owner"
wait "$owner" 2>/dev/null
check "once that caller is gone, up succeeds" 0 "$(up_rc)"
"$T" down

# Made by an older test-hosts (no owner record): left over once no holder lives or once older
# than any test's time limit.
up_and_die
rm "$STATE/owner"
check "no owner record, holders alive, recent: refused" 3 "$(up_rc)"
touch -d '-20 min' "$STATE/hosts"
check "no owner record, older than any test: taken down" 0 "$(up_rc)"
"$T" down
up_and_die
rm "$STATE/owner"
pkill -9 -f shardgather-test-host-sg-h
sleep 0.3
check "no owner record, no holder alive: taken down" 0 "$(up_rc)"
"$T" down

# Our bridge without the state dir (a lost /run).
up_and_die
pkill -9 -f shardgather-test-host-sg-h
rm -rf "$STATE"
check "our bridge without a state dir: taken down" 0 "$(up_rc)"
"$T" down
check "down leaves no bridge" 1 "$(ip link show sgbr0 >/dev/null 2>&1; echo $?)"

echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
