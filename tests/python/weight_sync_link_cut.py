"""A link cut mid-sync on the simulated hosts (issue 27's fault case; docs/reliability.md):

    tests/python/weight_sync_link_cut.py          # the driver: 2 hosts x 2 ranks, exit 0/1/77

The driver runs this file again under tools/netns-mpirun (MPI over TCP between the hosts). Rank 0
is the trainer, ranks 1-3 three replicas of the engine; ranks 0-1 on host 0, 2-3 on host 1. The
ranks sync a few MB every step; 300 ms in, rank 2 takes its host's link down for 3 deadlines
(`ip link set eth0 down` inside the host) and up again. Every rank, on both hosts, must raise
within [0.5, 2] x the deadline of the sync it was in, never hang; each then ends the job with
MPI_Abort (the documented way out of a failed MPI job), which completes once the link is back.
"""

import os
import re
import subprocess
import sys
import time

DEADLINE = 2.0
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def rank_main():
    from mpi4py import MPI

    import torch

    import shardgather
    sys.path.insert(0, HERE)
    import weight_sync_cases as cases
    from shardgather.weight_sync import WeightSync

    comm = shardgather.mpi_communicator(MPI.COMM_WORLD)
    rank = comm.rank
    big = [((1024, 512), torch.float32), ((512, 1024), torch.bfloat16)]
    ws = WeightSync(cases.layouts_for(comm.size, model=big), comm, timeout=DEADLINE,
                    bucket_bytes=1 << 16)
    full = cases.initial(model=big)
    ws.sync(0, cases.shard_views(ws, full))
    began_loop = time.monotonic()
    cut = False
    for k in range(1, 10000):
        if rank == 2 and not cut and time.monotonic() - began_loop > 0.3:
            subprocess.Popen(["sh", "-c", "ip link set eth0 down; sleep %g; ip link set eth0 up"
                              % (3 * DEADLINE)])
            cut = True
        for t in full:
            t.add_(1)
        began = time.monotonic()
        try:
            ws.sync(k, cases.shard_views(ws, full))
        except shardgather.ShardgatherError as e:
            print("WSCUT rank %d step %d %s %.3f" % (rank, k, type(e).__name__,
                                                     time.monotonic() - began), flush=True)
            MPI.COMM_WORLD.Abort(3)
        if time.monotonic() - began_loop > 30:
            print("WSCUT rank %d no error after 30 s" % rank, flush=True)
            MPI.COMM_WORLD.Abort(4)


def driver():
    probe = subprocess.run([os.path.join(ROOT, "tools", "test-hosts"), "probe"],
                           capture_output=True, text=True)
    if probe.returncode:
        print((probe.stdout + probe.stderr).strip())
        return probe.returncode
    cmd = ["timeout", "-k", "20", "-s", "TERM", "120", os.path.join(ROOT, "tools", "netns-mpirun"),
           "--hosts", "2", "--per-host", "2", "--", sys.executable, os.path.abspath(__file__),
           "--rank"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    out = r.stdout + r.stderr
    errors = {int(m.group(1)): (m.group(2), float(m.group(3))) for m in re.finditer(
        r"WSCUT rank (\d+) step \d+ (\w+) ([\d.]+)", out)}
    print("per rank (error, seconds of the sync that failed):", errors)
    ok = sorted(errors) == [0, 1, 2, 3] and all(
        0.5 * DEADLINE <= s <= 2 * DEADLINE for _, s in errors.values())
    if not ok:
        print(out[-4000:])
    print("link cut mid-sync: %s" % ("every rank raised within [0.5, 2] x the deadline" if ok
                                     else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(rank_main() if "--rank" in sys.argv else driver())
