#!/usr/bin/python3
"""H2: launch mpi_cases under a hard kill timeout, join the ranks' JSON lines, judge each case.

Each launch is `timeout -s KILL <D> mpirun --allow-run-as-root --oversubscribe -np W mpi_cases
--out-dir <tmp> <ids>`; every rank writes one JSON line per case to <tmp>/rank<r>.jsonl. A
rank with no line is "killed or hung". After each launch, `pgrep -f <binary>` must find
nothing once the launcher has killed what the job left (orphans), and what it had to kill is
reported as "leftover". Ends with the plain line `N passed, M failed`.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

ARGS = None  # the parsed command line (launcher() needs the tools directory)
STUCK_S = 10  # how long mpirun may outlive every rank before it counts as stuck in teardown

B_IDS = "B1 B2 B3a B3b B4 B5 B6 B7c B8 B9a B9b B10 B11a B11b B12 B13 B14".split()
M_IDS = "M1 M2 M3 M4 M5a M5b M6 M7a M8 M9".split()
M_NAKED = "M1 M2 M3 M4 M5a M5b M6 M7a".split()


def d_ids(binary, np_):
    """The generated disagreement family's ids that run at np_ ranks (from the binary)."""
    r = subprocess.run([binary, "--list-d"], capture_output=True, text=True, check=True)
    rows = [line.split() for line in r.stdout.splitlines() if line.strip()]
    return [cid for cid, min_world in rows if int(min_world) <= np_]


def launches(families, nps, big, binary=None):
    out = []
    for np_ in nps:
        if "D" in families:
            out.append(dict(name="D", np=np_, ids=d_ids(binary, np_), job="clean"))
        if "B" in families or "M" in families:
            ids = (B_IDS if "B" in families else []) + (M_IDS if "M" in families else [])
            out.append(dict(name="BM", np=np_, ids=ids, job="clean"))
        if "M" in families:
            out.append(dict(name="M7b", np=np_, ids=["M7b"], job="aborts"))
            out.append(dict(name="M-naked", np=np_, ids=M_NAKED, job="any", naked=True))
    if "F" in families:
        for how in ("kill", "exit", "abort", "segv"):
            out.append(dict(name="F5-" + how, np=3, ids=["F5-" + how], job="killed"))
        for cid in ("F6-stop", "F6-sleep", "F6-mid-stop", "F7-stop", "F7-sleep"):
            out.append(dict(name=cid, np=2, ids=[cid], job="aborts"))
        out.append(dict(name="F7-stop", np=3, ids=["F7-stop"], job="aborts"))
        out.append(dict(name="F8", np=2, ids=["F8"], job="clean"))
        out.append(dict(name="F9", np=2, ids=["F9"], job="any"))
        # Across two simulated hosts (tools/netns-mpirun), one and two ranks per host.
        for per_host in (1, 2):
            out.append(dict(name="F12-link", np=2 * per_host, ids=["F12-link"], job="aborts",
                            per_host=per_host))
            out.append(dict(name="F13-host", np=2 * per_host, ids=["F13-host"],
                            job="killed", per_host=per_host))
    if "L" in families:
        for np_ in nps:
            out.append(dict(name="L1", np=np_, ids=["L1"], job="clean"))
        out.append(dict(name="L2", np=2, ids=["L2"], job="clean"))
        out.append(dict(name="L4", np=2, ids=["L4"], job="clean"))
    if "OVH" in families:
        out.append(dict(name="OVH", np=2, ids=["OVH"], job="clean"))
        out.append(dict(name="OVH-threads", np=1, ids=["OVH-threads"], job="clean"))
    for x in ("X2", "X3"):
        if x in families:
            out.append(dict(name=x, np=2, ids=[x], job="clean", deadline=1800))
    return out


def pgrep(binary):
    r = subprocess.run(["pgrep", "-f", binary], capture_output=True, text=True)
    # This launcher's own command line names the binary too (--bin): never count it.
    mine = {os.getpid(), os.getppid()}
    return [int(p) for p in r.stdout.split() if int(p) not in mine]


def hosts_probe(args):
    """0 when simulated hosts can be made; else test-hosts' own verdict (77 skip, 1 fail)."""
    r = subprocess.run([os.path.join(args.tools, "test-hosts"), "probe"], capture_output=True,
                       text=True)
    return r.returncode, (r.stdout + r.stderr).strip()


def launcher(spec, deadline):
    if "per_host" not in spec:
        return ["timeout", "-s", "KILL", str(deadline), "mpirun", "--allow-run-as-root",
                "--oversubscribe", "-np", str(spec["np"])]
    # SIGTERM first: netns-mpirun then takes its hosts down, and whatever ran in them.
    os.environ["SHARDGATHER_TEST_RANKS_PER_HOST"] = str(spec["per_host"])
    return ["timeout", "-k", "20", "-s", "TERM", str(deadline),
            os.path.join(ARGS.tools, "netns-mpirun"), "--hosts", "2", "--per-host",
            str(spec["per_host"])]


def live_ranks(binary):
    """The ranks that still run: the launchers' command lines name the binary too, and a zombie
    has ended (only its parent has yet to reap it)."""
    live = []
    for pid in pgrep(binary):
        try:
            with open("/proc/%d/stat" % pid) as fh:
                comm, rest = fh.read().split(" (", 1)[1].rsplit(") ", 1)
        except (OSError, IndexError, ValueError):
            continue
        if comm == os.path.basename(binary)[:15] and rest.split()[0] not in ("Z", "X"):
            live.append(pid)
    return live


def launch_and_watch(cmd, binary, watch):
    """Runs one launch; returns (completed process, launcher_stuck).

    Open MPI 4.1's mpirun (PMIx 4.2, Debian 12) sometimes never returns when one rank has
    finalized and another calls MPI_Abort: every rank has ended (its zombies wait to be reaped)
    while mpirun's main thread waits in PMIx_server_finalize for a progress thread blocked on
    a PMIx mutex. A 20-line MPI program without this library shows it in about 1 launch in 10
    (docs/reliability.md). Where watch is set, a launcher that outlives all of its ranks by
    STUCK_S is ended here and reported as stuck, not hung: a hang is a rank that still runs.
    """
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    seen = stuck = False
    quiet_since = None
    while True:
        try:
            # Reading as we wait: a launcher blocked on a full pipe must not look stuck.
            out, err = proc.communicate(timeout=0.5 if watch else None)
            break
        except subprocess.TimeoutExpired:
            pass
        live = live_ranks(binary)
        seen = seen or bool(live)
        quiet_since = None if live or not seen else (quiet_since or time.monotonic())
        if quiet_since and time.monotonic() - quiet_since > STUCK_S and proc.poll() is None:
            stuck = True
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), stuck


def run_launch(args, spec, timeout_ms):
    deadline = spec.get("deadline", args.deadline)
    with tempfile.TemporaryDirectory(prefix="sg-h2-") as tmp:
        cmd = launcher(spec, deadline)
        for var in ("UBSAN_OPTIONS", "SHARDGATHER_SOAK_ITERS",
                    "SHARDGATHER_L4_MIB", "SHARDGATHER_M9_CALLS"):
            if var in os.environ:
                cmd += ["-x", var]
        if "ASAN_OPTIONS" in os.environ:
            # Open MPI's dlclose'd plugins "leak" about 120 KB per rank (RELIABILITY E13).
            cmd += ["-x", "ASAN_OPTIONS=%s:detect_leaks=0" % os.environ["ASAN_OPTIONS"]]
        cmd += ["--"] if "per_host" in spec else []
        cmd += [args.bin, "--out-dir", tmp, "--timeout-ms", str(timeout_ms)]
        cmd += ["--naked"] if spec.get("naked") else []
        cmd += spec["ids"]
        t0 = time.monotonic()
        proc, stuck = launch_and_watch(cmd, args.bin, watch="per_host" not in spec)
        wall = time.monotonic() - t0
        leftover = pgrep(args.bin)
        for pid in leftover:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2 if leftover else 0)
        orphans = pgrep(args.bin)
        lines = []
        for f in sorted(os.listdir(tmp)):
            with open(os.path.join(tmp, f)) as fh:
                for line in fh:
                    line = line.strip()
                    if line:
                        try:
                            lines.append(json.loads(line))
                        except ValueError:
                            lines.append({"case": "?", "rank": -1, "bad_line": line})
    return dict(rc=proc.returncode, wall=wall, leftover=len(leftover), orphans=len(orphans),
                lines=lines, stderr=proc.stderr[-2000:], launcher_stuck=stuck,
                hung=(proc.returncode in (124, 137) or proc.returncode < 0)
                and wall >= deadline - 1 and not stuck)


def judge(spec, res, cid, timeout_s):
    """Returns (verdict dict) for one case of one launch."""
    np_ = spec["np"]
    mine = [l for l in res["lines"] if l.get("case") == cid]
    ranks = {l["rank"] for l in mine}
    problems = []
    v = dict(case=cid, np=np_, naked=bool(spec.get("naked")), family=cid[0], wall=res["wall"],
             rc=res["rc"], orphans=res["orphans"], leftover=res["leftover"], hung=res["hung"],
             t_err_over_t=[], silent=0, lost_bytes=0, uniform=None, skipped=False, lines=mine,
             launcher_stuck=res["launcher_stuck"], launch=spec["name"])
    if res["orphans"]:
        problems.append("%d orphan processes" % res["orphans"])
    if spec.get("naked"):
        v["problems"] = problems
        return v
    if spec["job"] == "killed":
        if res["rc"] == 0:
            problems.append("mpirun exited 0 after a rank died")
        if res["wall"] > 10:
            problems.append("job took %.1f s to end (> 10 s)" % res["wall"])
        if res["leftover"]:
            problems.append("%d processes left after mpirun" % res["leftover"])
        ok_lines = [l for l in mine if l.get("outcome") == "ok"]
        if ok_lines:
            problems.append("rank(s) %s reported success" % [l["rank"] for l in ok_lines])
            v["silent"] = len(ok_lines)
        v["problems"] = problems
        return v
    if res["hung"]:
        problems.append("killed by the %s s hard deadline (hung)" % spec.get("deadline", 0))
    if spec["job"] == "clean" and res["rc"] != 0:
        problems.append("mpirun exited %d" % res["rc"])
    stall = cid.startswith(("F6", "F7"))
    needed = range(np_) if not (stall and "mid" in cid) else [r for r in range(np_) if r != 1]
    if cid == "F9":
        needed = [1]
    for r in needed:
        if r not in ranks:
            problems.append("rank %d reported nothing (killed or hung)" % r)
    errs = [l for l in mine if l.get("err_class") not in ("Ok",)]
    oks = [l for l in mine if l.get("err_class") == "Ok"]
    for l in mine:
        who = "rank %d: " % l["rank"]
        if stall and "mid" in cid and l["rank"] == 1:
            continue
        if l.get("outcome") == "skipped":
            v["skipped"] = True
            continue
        if l["err_class"] != l["expect"]:
            problems.append(who + "expected %s, got %s (%s)" % (l["expect"], l["err_class"],
                                                               l["err_msg"][:160]))
        if not l.get("msg_ok", True):
            problems.append(who + "message lacks the expected fields: " + l["err_msg"][:160])
        if l.get("in_changed"):
            problems.append(who + "inputs changed")
        if not l.get("sentinel_ok", True):
            problems.append(who + "sentinel violated")
        if l.get("out_mismatch_bytes"):
            problems.append(who + "%d bytes differ" % l["out_mismatch_bytes"])
            if l["err_class"] == "Ok" or l.get("outcome") == "ok":
                v["lost_bytes"] += l["out_mismatch_bytes"]
        if not l.get("followup_ok", True):
            problems.append(who + "follow-up failed: " + l.get("note", "")[:160])
        if l["err_class"] == "Timeout":
            ratio = l["t_err_s"] / timeout_s
            v["t_err_over_t"].append(ratio)
            if not 0.5 <= ratio <= 2:
                problems.append(who + "t_err %.2f T outside [0.5, 2]" % ratio)
    # A rank that returned success while another raised from the same call.
    if errs and oks and all(l["expect"] != "Ok" for l in mine):
        v["silent"] = len(oks)
    expects = {l["expect"] for l in mine}
    v["uniform"] = (not problems) if expects - {"Ok"} else None
    v["problems"] = problems
    return v


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--bin", required=True)
    ap.add_argument("--np", default="2,3")
    ap.add_argument("--families", default="B,M,F,L")
    ap.add_argument("--timeout-ms", type=int, default=2000, help="T, the per-call deadline")
    ap.add_argument("--deadline", type=int, default=60, help="hard kill per launch, seconds")
    ap.add_argument("--summary", help="write one JSON verdict per case here")
    ap.add_argument("--tools", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                    "..", "..", "tools"),
                    help="where test-hosts and netns-mpirun are (the cases across hosts)")
    args = ap.parse_args()
    global ARGS
    ARGS = args
    args.bin = os.path.abspath(args.bin)
    for var in ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM",
                "OMPI_MCA_rmaps_base_oversubscribe"):
        os.environ.setdefault(var, "1")
    families = set(args.families.split(","))
    nps = [int(x) for x in args.np.split(",")]
    passed = failed = 0
    verdicts = []
    if pgrep(args.bin):
        print("processes of %s already running; refusing to start" % args.bin)
        return 2
    probe = None
    for spec in launches(families, nps, False, args.bin):
        if "per_host" in spec:
            probe = probe or hosts_probe(args)
            if probe[0] != 0:
                ok = probe[0] == 77  # skipped here; under SHARDGATHER_REQUIRE_TEST_HOSTS=1, failed
                print("%s %-22s %s" % ("SKIP" if ok else "FAIL",
                                       "%s np=%d" % (spec["name"], spec["np"]), probe[1]))
                failed += not ok
                continue
        res = run_launch(args, spec, args.timeout_ms)
        for cid in spec["ids"]:
            if cid[0] in "BM" and spec["np"] < 2 and cid not in ("B1",):
                continue
            v = judge(spec, res, cid, args.timeout_ms / 1000)
            verdicts.append(v)
            tag = cid + ("-naked" if v["naked"] else "") + " np=%d" % spec["np"]
            if v["naked"]:
                outs = ", ".join("r%d %s%s" % (l["rank"], l["err_class"],
                                             " (%d B differ)" % l["out_mismatch_bytes"]
                                             if l.get("out_mismatch_bytes") else "")
                                 for l in sorted(v["lines"], key=lambda l: l["rank"]))
                print("RECORD %-22s %s" % (tag, outs or "no lines (job ended)"))
                continue
            ok = not v["problems"]
            passed += ok
            failed += not ok
            extra = ""
            if v["t_err_over_t"]:
                extra = " t_err/T=" + ",".join("%.2f" % x for x in v["t_err_over_t"])
            if spec["job"] != "clean":
                extra += " job rc=%d wall=%.2fs leftover=%d" % (res["rc"], res["wall"],
                                                                 res["leftover"])
            if res["launcher_stuck"]:
                extra += " (mpirun outlived every rank by %d s: stuck in PMIx teardown, ended)" \
                    % STUCK_S
            shown = [l for l in v["lines"] if l["rank"] == 0 or not cid.startswith("OVH")]
            notes = "; ".join(l.get("note", "") for l in shown
                              if cid in ("OVH", "OVH-threads", "L1", "L2", "L4", "X2", "X3"))
            print("%s %-22s%s%s" % ("PASS" if ok else "FAIL", tag, extra,
                                    (" " + notes[:400]) if notes else ""))
            for p in v["problems"]:
                print("     " + p)
            if not ok and res["stderr"].strip():
                print("     stderr: " + res["stderr"].strip().replace("\n", "\n     ")[-800:])
    if args.summary:
        with open(args.summary, "w") as fh:
            for v in verdicts:
                fh.write(json.dumps(v) + "\n")
    print("%d passed, %d failed" % (passed, failed))
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
