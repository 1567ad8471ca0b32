"""A trainer group and an engine group in one job, synced by shardgather.weight_sync
(docs/weight-sync.md): 6 processes on Gloo, ranks 0-1 train an embedding table and a projection
(FSDP rows), ranks 2-5 serve them as two replicas of TP 2 (a column split). The embedding's
gradient is sparse (only the rows of a batch's tokens change), so each sync sends a few rows'
bytes, and only to the engine ranks whose columns they are.

    PYTHONPATH=build/ci/python .venv/bin/python examples/weight_sync.py

Every engine rank checks, at the end, that it holds the trainer's last weights bit for bit."""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TRAINERS, TP, REPLICAS, STEPS = 2, 2, 2, 8
SHAPES = {"embed": (1000, 64), "proj": (64, 64)}


def layout(shape):
    from shardgather.layouts import Box, TensorLayout

    rows, cols = shape
    sources = [(r, Box((r * rows // TRAINERS, 0), (rows // TRAINERS, cols)))
               for r in range(TRAINERS)]
    destinations = [(TRAINERS + g * TP + k, Box((0, k * cols // TP), (rows, cols // TP)))
                    for g in range(REPLICAS) for k in range(TP)]
    return TensorLayout(shape, torch.float32, sources, destinations)


def run(rank, world, init_file, results):
    from shardgather.weight_sync import WeightSync

    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=world)
    sync_group = dist.new_group(backend="gloo")  # the sync's own group: it may run on a thread
    names = list(SHAPES)
    ws = WeightSync([layout(SHAPES[n]) for n in names], sync_group, mode="staged", timeout=60)
    torch.manual_seed(0)  # every rank the same initial model
    full = {n: torch.randn(SHAPES[n]) for n in names}
    if rank < TRAINERS:
        # the trainer's own rows, as FSDP holds them
        params = {n: torch.nn.Parameter(full[n][ws.source_boxes[i][1][0]:][
            :ws.source_boxes[i][2][0]].clone()) for i, n in enumerate(names)}
        optimizer = torch.optim.SGD(params.values(), lr=0.1)
        for step in range(STEPS):
            tokens = torch.randint(params["embed"].shape[0], (16,))  # this rank's batch
            loss = params["embed"][tokens].square().mean()  # proj is frozen this phase
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            work = ws.start(step, [params[n].detach() for n in names])
            # the next step may run here: the sync has its copy
            stats = work.wait()
            print("trainer %d step %d: sent %d bytes" % (rank, step, stats["bytes_sent"]))
        mine = [params[n].detach() for n in names]
    else:
        for step in range(STEPS):
            stats = ws.sync(step)
            with ws.read() as (version, tensors):  # one version, whole
                assert version == step
            print("engine %d step %d: received %d bytes" % (rank, step,
                                                            stats["bytes_received"]))
        mine = []
    # the check: every trainer shard to every rank (plain torch), then each engine's boxes
    gathered = [None] * world
    dist.all_gather_object(gathered, [t.clone() for t in mine])
    if rank >= TRAINERS:
        rows = {n: torch.cat([gathered[r][i] for r in range(TRAINERS)]) for i, n in
                enumerate(names)}
        with ws.read() as (_, tensors):
            for (t, offset, size), have in zip(ws.destination_boxes, tensors):
                want = rows[names[t]][:, offset[1]:offset[1] + size[1]]
                assert torch.equal(have, want), (rank, names[t])
    results.put(rank)
    dist.destroy_process_group()


def main():
    world = TRAINERS + TP * REPLICAS
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="sg-weight-sync-")
    os.close(fd)
    os.unlink(init_file)
    procs = [ctx.Process(target=run, args=(r, world, init_file, results)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    done = sorted(results.get(timeout=5) for _ in range(world))
    ok = done == list(range(world)) and all(p.exitcode == 0 for p in procs)
    print("weight sync example: %s" % ("every engine rank bit-exact" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
