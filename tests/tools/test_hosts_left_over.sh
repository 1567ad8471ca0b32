#!/usr/bin/env bash
# tools/test-hosts: hosts left over by a killed job do not block the next job's `up`, and hosts
# whose owner still runs (or that were brought up by hand) are never taken from it.
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
log=$(mktemp)
# Brings 2 hosts up for a job whose owner is then SIGKILLed, as a CI time limit would.
up_and_die() { (bash -c "'$T' up 2 --owner \$\$ 2>>'$log'; kill -9 \$\$"; true) 2>/dev/null; }
up_rc() { local rc=0; "$T" up 2 --owner $$ 2>>"$log" || rc=$?; echo "$rc"; }
# The holders of the hosts recorded in the state dir (never anyone else's processes).
holders() { cat "$STATE"/h*.pid 2>/dev/null | sort | tr '\n' ' '; }
kill_holders() {
  local p
  for p in $(holders); do kill -9 "$p"; done
  sleep 0.3
}
# Hosts up for someone else's job: not ours to take down.
if [ "$(up_rc)" = 3 ]; then
  echo "skipped: test hosts are up and in use: $(cat "$log")"
  rm -f "$log"
  exit 77
fi
trap '"$T" down; rm -f "$log"' EXIT
"$T" down

up_and_die
check "a killed job's hosts are taken down by the next up" 0 "$(up_rc)"
grep -q "left over from a run that is gone" "$log"
check "  ... which says so" 0 $?
"$T" down

# An owner killed but not yet reaped (a zombie) is gone too.
python3 -c '
import os, subprocess, sys, time
owner = subprocess.Popen(["sleep", "100"])
subprocess.run([sys.argv[1], "up", "2", "--owner", str(owner.pid)], stderr=subprocess.DEVNULL)
os.kill(owner.pid, 9)
time.sleep(15)  # not reaping it meanwhile' "$T" &
zombie_parent=$!
for _ in $(seq 100); do
  [ -e "$STATE/owner" ] && [ "$(awk '{print $3}' "/proc/$(cut -d' ' -f1 "$STATE/owner")/stat" 2>/dev/null)" = Z ] && break
  sleep 0.1
done
check "a killed owner not yet reaped counts as gone" 0 "$(up_rc)"
kill "$zombie_parent"
wait "$zombie_parent" 2>/dev/null
"$T" down

# A job still running: its hosts stay, with their holders.
bash -c "'$T' up 2 --owner \$\$ 2>/dev/null; sleep 60" &
owner=$!
for _ in $(seq 100); do [ -e "$STATE/h1.netns" ] && break; sleep 0.1; done
before=$(holders)
check "a running job's hosts are refused (exit 3)" 3 "$(up_rc)"
check "  ... and left as they were" "$before" "$(holders)"
kill "$owner"
wait "$owner" 2>/dev/null
check "once that job is gone, up succeeds" 0 "$(up_rc)"
"$T" down

# By hand (no owner; e.g. through sudo, which exits at once): they stay until `down`.
(bash -c "'$T' up 2 2>/dev/null; kill -9 \$\$"; true) 2>/dev/null
check "hosts brought up by hand are refused" 3 "$(up_rc)"
kill_holders
check "  ... unless no holder lives" 0 "$(up_rc)"
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
kill_holders
check "no owner record, no holder alive: taken down" 0 "$(up_rc)"
"$T" down

# Our bridge without the state dir (a lost /run).
up_and_die
kill_holders
rm -rf "$STATE"
check "our bridge without a state dir: taken down" 0 "$(up_rc)"
"$T" down
check "down leaves no bridge" 1 "$(ip link show sgbr0 >/dev/null 2>&1; echo $?)"

echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
