"""Messages of any size between the ranks of one communicator, over reshard plans: an all-gather
of a small int64 row per rank (the sizes, the votes), then one reshard of byte tensors in which
rank s's message to rank d is a box of d's receive buffer. The weight sync (weight_sync.py)
runs every round of its protocol through these two calls, so each round is a call of the call
protocol: a deadline, a pre-flight check, and an error on every rank when one rank fails."""

import torch

from .layouts import Box, TensorLayout


class Exchange:
    """The two rounds of one communicator. Not thread-safe: one call at a time, and every rank
    of ``comm`` makes the same calls in the same order (as for any collective)."""

    def __init__(self, comm, timeout):
        self.comm, self.timeout = comm, timeout
        self._row_plans = {}  # width -> plan
        self._payload = None  # (size table as a tuple, plan) of the last payload round
        self._recv = torch.empty(0, dtype=torch.uint8)

    def _plan(self, layouts):
        from . import ReshardPlan  # the package imports the modules that import this one

        return ReshardPlan(layouts, self.comm.size, self.comm.rank, fan_out=False,
                           timeout=self.timeout)

    def held_bytes(self):
        """The receive buffer kept for the next round (the largest received so far)."""
        return self._recv.numel()

    def all_rows(self, row):
        """Every rank's int64 ``row`` (the same width on every rank) as a [world, width] table,
        the same on every rank."""
        world = self.comm.size
        width = row.numel()
        plan = self._row_plans.get(width)
        if plan is None:
            layout = TensorLayout(
                (world, width), torch.int64,
                [(q, Box((q, 0), (1, width))) for q in range(world)],
                [(q, Box((0, 0), (world, width))) for q in range(world)])
            plan = self._row_plans[width] = self._plan([layout])
        table = torch.empty(world, width, dtype=torch.int64)
        plan.execute([row.reshape(1, width)], [table], self.comm)
        return table

    def messages(self, outgoing):
        """``outgoing``: peer -> a 1-d uint8 tensor for it (absent or empty: nothing). Returns
        (peer -> the bytes it sent here, views of one reused buffer valid until the next call;
        the [world, world] size table, the same on every rank). A message to this rank itself is
        handed back without a copy."""
        world, rank = self.comm.size, self.comm.rank
        sizes = torch.zeros(world, dtype=torch.int64)
        for peer, m in outgoing.items():
            sizes[peer] = m.numel()
        table = self.all_rows(sizes)
        received = {}
        if outgoing.get(rank) is not None and outgoing[rank].numel():
            received[rank] = outgoing[rank]
        cross = table.clone()
        cross.fill_diagonal_(0)
        if not bool(cross.any()):
            return received, table
        key = tuple(cross.reshape(-1).tolist())
        if self._payload is None or self._payload[0] != key:
            layouts, owners = [], []
            for d in range(world):
                column = cross[:, d].tolist()
                total = sum(column)
                if total == 0:
                    continue
                sources, at = [], 0
                for s, n in enumerate(column):
                    if n:
                        sources.append((s, Box((at,), (n,))))
                    at += n
                layouts.append(TensorLayout((total,), torch.uint8, sources,
                                            [(d, Box((0,), (total,)))]))
                owners.append(d)
            self._payload = (key, self._plan(layouts), owners)
        _, plan, owners = self._payload
        sends = [outgoing[owners[t]] for t, _, _ in plan.source_boxes]
        destinations = []
        if plan.destination_boxes:
            total = int(cross[:, rank].sum())
            if self._recv.numel() < total:
                self._recv = torch.empty(total, dtype=torch.uint8)
            destinations = [self._recv[:total]]
        plan.execute(sends, destinations, self.comm)
        at = 0
        for s in range(world):
            n = int(cross[s, rank])
            if n:
                received[s] = self._recv[at:at + n]
            at += n
        return received, table
