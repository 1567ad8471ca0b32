"""The torch Gloo suite across simulated hosts (tools/test-hosts): every case of gloo_cases.py,
and the host facts of hosts_cases.py, on a Gloo group whose ranks run K per host on H hosts.

    across_hosts.py [--hosts 2] [--per-host 2] [--timeout 400]

Brings the hosts up, starts each rank inside its host (`test-hosts exec`, TCP rendezvous at
host 0's address, Gloo on the host's eth0), collects each rank's verdict per case, and takes the
hosts down on every exit. Ends with `N passed, M failed`. Without namespaces `test-hosts probe`
decides: exit 77 (skipped), or 1 where SHARDGATHER_REQUIRE_TEST_HOSTS=1 (CI).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TEST_HOSTS = os.path.join(HERE, "..", "..", "tools", "test-hosts")
PORT = 29517


def worker(rank, world, init_method, out):
    """One rank, inside its host: every case, one JSON line each."""
    sys.path.insert(0, HERE)
    import conftest
    import hosts_cases

    with open(out, "a") as f:
        def report(name, r, tb):
            f.write(json.dumps({"case": name, "rank": r, "traceback": tb}) + "\n")
            f.flush()

        conftest.run_case_list(rank, world, init_method, "hosts_cases", hosts_cases.CASES, report)
    os._exit(0)  # as conftest's workers: no c10d destructors


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--per-host", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=400)
    ap.add_argument("--worker", nargs=4, metavar=("RANK", "WORLD", "INIT", "OUT"))
    args = ap.parse_args()
    if args.worker:
        rank, world, init, out = args.worker
        worker(int(rank), int(world), init, out)
        return 0
    probe = subprocess.run([TEST_HOSTS, "probe"])
    if probe.returncode != 0:
        return probe.returncode
    # This process is the hosts' owner (tools/test-hosts: left over once it is gone).
    up = subprocess.run([TEST_HOSTS, "up", str(args.hosts), "--owner", str(os.getpid())])
    if up.returncode != 0:
        return up.returncode
    world = args.hosts * args.per_host
    try:
        addr = subprocess.run([TEST_HOSTS, "addr", "0"], capture_output=True, text=True,
                              check=True).stdout.strip()
        with tempfile.TemporaryDirectory(prefix="sg-hosts-") as tmp:
            # A second run of port 0 is not possible across hosts: a fixed port on host 0's
            # private address, which only these hosts can reach.
            init = "tcp://%s:%d" % (addr, PORT)
            env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0",
                       SHARDGATHER_TEST_RANKS_PER_HOST=str(args.per_host))
            procs = []
            for r in range(world):
                cmd = [TEST_HOSTS, "exec", str(r // args.per_host), sys.executable,
                       os.path.abspath(__file__), "--worker", str(r), str(world), init,
                       os.path.join(tmp, "rank%d.jsonl" % r)]
                procs.append(subprocess.Popen(cmd, env=env))
            deadline = time.monotonic() + args.timeout
            for p in procs:
                try:
                    p.wait(timeout=max(1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    print("a rank did not finish within %.0f s: killing" % args.timeout)
                    for q in procs:
                        q.kill()
                    break
            results = {}
            for r in range(world):
                path = os.path.join(tmp, "rank%d.jsonl" % r)
                if os.path.exists(path):
                    for line in open(path):
                        row = json.loads(line)
                        results.setdefault(row["case"], {})[row["rank"]] = row["traceback"]
    finally:
        subprocess.run([TEST_HOSTS, "down"])
    import hosts_cases

    passed = failed = 0
    for name in hosts_cases.CASES:
        per_rank = results.get(name, {})
        missing = [r for r in range(world) if r not in per_rank]
        bad = {r: tb for r, tb in per_rank.items() if tb is not None}
        ok = not missing and not bad
        passed += ok
        failed += not ok
        print("%s %s (%d hosts x %d)" % ("PASS" if ok else "FAIL", name, args.hosts,
                                         args.per_host))
        for r, tb in sorted(bad.items()):
            print("  rank %d:\n%s" % (r, tb))
        if missing:
            print("  ranks %s never reported (hung or died)" % missing)
    print("%d passed, %d failed" % (passed, failed))
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    sys.exit(main())
