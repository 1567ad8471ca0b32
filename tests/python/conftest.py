"""Multi-process harness: runs case functions on every rank of a Gloo group of spawned
processes (FileStore rendezvous, so nothing but loopback is used) and reports per case."""

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import traceback

import pytest
import torch.multiprocessing as mp

# The tests import shardgather from the build tree: ctest sets PYTHONPATH; by hand, see
# docs/python.md.
sys.path.insert(0, os.path.dirname(__file__))

HARNESS_TIMEOUT_S = 150


def rank_context():
    """The multiprocessing context for rank processes: a fork server that has imported torch
    once (about 3 s of CPU per import on a CI core), from which each rank is forked. Ranks still
    start clean: the server is a fresh interpreter that imported only torch, and each rank imports
    shardgather itself (what it reads once per process, it reads in the rank)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    return ctx


def run_case_list(rank, world, init_method, module_name, case_names, report):
    """On one rank: joins the Gloo group at `init_method`, runs each case and calls
    report(case, rank, traceback or None); returns whether a case ended this rank's process
    early (it did not return to its peers). Also used across hosts (across_hosts.py)."""
    import importlib
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    module = importlib.import_module(module_name)
    for name in case_names:
        outcome = None
        try:
            outcome = getattr(module, name)(rank, world)
            report(name, rank, None)
        except BaseException:  # noqa: B902  (everything is reported, nothing escapes)
            report(name, rank, traceback.format_exc())
        if outcome == "exit":  # the case ends this rank's process; its peers watch it go
            return True
        if not name.startswith(("timeout_", "exit_")):  # a spoiled group cannot meet again
            dist.barrier()
    return False


def _worker(rank, world, init_file, module_name, case_names, queue):
    run_case_list(rank, world, "file://" + init_file, module_name, case_names,
                  lambda name, r, tb: queue.put((name, r, tb)))
    queue.close()
    queue.join_thread()
    # Skip c10d's destructors: a case that leaves abandoned work (timeouts) must not hang exit.
    os._exit(0)


def run_cases(module_name, case_names, world):
    """{case: {rank: traceback or None}} for every case run on `world` spawned ranks."""
    ctx = rank_context()
    queue = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="sg-filestore-")
    os.close(fd)
    os.unlink(init_file)
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world, init_file, module_name, case_names, queue),
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results = {name: {} for name in case_names}
    expected = len(case_names) * world
    try:
        for _ in range(expected):
            name, rank, tb = queue.get(timeout=HARNESS_TIMEOUT_S)
            results[name][rank] = tb
    except Exception:  # queue.Empty: a rank hung or died
        pass
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    if os.path.exists(init_file):
        os.unlink(init_file)
    return results


class CaseResults:
    """Runs a module's cases once per world size and hands out per-case verdicts."""

    def __init__(self, module_name, case_names):
        self.module_name = module_name
        self.case_names = case_names
        self.cache = {}

    def check(self, world, name):
        if world not in self.cache:
            self.cache[world] = run_cases(self.module_name, self.case_names, world)
        per_rank = self.cache[world][name]
        missing = [r for r in range(world) if r not in per_rank]
        failed = {r: tb for r, tb in per_rank.items() if tb is not None}
        if failed:
            pytest.fail(
                "\n".join("rank %d:\n%s" % (r, tb) for r, tb in sorted(failed.items())),
                pytrace=False,
            )
        if missing:
            pytest.fail("ranks %s never reported (hung or died)" % missing, pytrace=False)


def on_default_group(check):
    """A check(rank, world, group) as a case(rank, world) of run_cases, on the default group."""
    def case(rank, world):
        check(rank, world, None)

    case.__name__ = "case_" + check.__name__[len("check_"):]
    return case


def run_ranks(world, fn):
    """fn(rank, comm) on one Python thread per rank of a ThreadGroup; returns the results."""
    import shardgather

    group = shardgather.ThreadGroup(world)
    results, errors = [None] * world, [None] * world

    def body(r):
        try:
            results[r] = fn(r, group[r])
        except BaseException as e:  # noqa: B902
            errors[r] = e

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results, errors


def check_on_threads(world, check):
    """check(rank, world, comm) on every rank of a ThreadGroup; raises naming the first rank
    whose check failed."""
    _, errors = run_ranks(world, lambda r, comm: check(r, world, comm))
    for r, e in enumerate(errors):
        if e is not None:
            raise AssertionError("rank %d: %r" % (r, e)) from e


def run_mpi_checks(module_name, np_, timeout):
    """Every check of ``module_name``.CHECKS, (rank, world, comm) on an MPI communicator over
    np_ ranks (see run_mpi_script)."""
    script = "\n".join([
        "import sys",
        "from mpi4py import MPI",
        "import shardgather",
        "sys.path.insert(0, sys.argv[1])",
        "import %s as cases" % module_name,
        "comm = shardgather.mpi_communicator(MPI.COMM_WORLD)",
        "for check in cases.CHECKS:",
        "    check(comm.rank, comm.size, comm)",
        "print('MPI-OK', comm.rank)",
    ])
    run_mpi_script(script, np_, timeout)


def run_mpi_script(script, np_, timeout):
    """Runs `script` (python -c, this directory as sys.argv[1]) on np_ MPI ranks and checks that
    every rank printed MPI-OK. Skips without mpi4py or mpirun."""
    pytest.importorskip("mpi4py")
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("no mpirun")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    proc = subprocess.run(
        [mpirun, "-np", str(np_), "--oversubscribe", sys.executable, "-c", script,
         os.path.dirname(os.path.abspath(__file__))],
        env=env, capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("MPI-OK") == np_, proc.stdout + proc.stderr
