"""Messages of any size between the ranks of one communicator, over reshard plans: an all-gather
of a small int64 row per rank (the sizes, the votes), then one reshard of byte tensors in which
rank s's message to rank d is a box of d's receive buffer. The weight sync (weight_sync.py)
runs every round of its protocol through these two calls, so each round is a call of the call
protocol: a deadline, a pre-flight check, and an error on every rank when one rank fails. Each
round names its step (``"<op>: <round>"``, the stage its header carries), so that no round can
pair with another rank's other round or with any other call."""

import torch

from .layouts import Box, TensorLayout


class Exchange:
    """The two rounds of one communicator. Not thread-safe: one call at a time, and every rank
    of ``comm`` makes the same calls in the same order (as for any collective)."""

    def __init__(self, comm, timeout, op):
        self.comm, self.timeout, self.op = comm, timeout, op
        self._row_plans = {}  # (width, round) -> plan
        self._payload = {}  # round -> (size table as a tuple, plan, owners) of its last call
        self._recv = torch.empty(0, dtype=torch.uint8)

    def stage(self, name):
        """The stage of round ``name`` (what a peer's failure must name to fail it)."""
        return "%s: %s" % (self.op, name)

    def _plan(self, layouts, name):
        from . import ReshardPlan  # the package imports the modules that import this one

        return ReshardPlan(layouts, self.comm.size, self.comm.rank, fan_out=False,
                           timeout=self.timeout, _stage=self.stage(name))

    def held_bytes(self):
        """The receive buffer kept for the next round (the largest received so far)."""
        return self._recv.numel()

    def all_rows(self, row, name):
        """Every rank's int64 ``row`` (the same width on every rank) as a [world, width] table,
        the same on every rank; ``name``: the round."""
        world = self.comm.size
        width = row.numel()
        plan = self._row_plans.get((width, name))
        if plan is None:
            layout = TensorLayout(
                (world, width), torch.int64,
                [(q, Box((q, 0), (1, width))) for q in range(world)],
                [(q, Box((0, 0), (world, width))) for q in range(world)])
            plan = self._row_plans[(width, name)] = self._plan([layout], name)
        table = torch.empty(world, width, dtype=torch.int64)
        plan.execute([row.reshape(1, width)], [table], self.comm)
        return table

    def messages(self, outgoing, name):
        """``outgoing``: peer -> a 1-d uint8 tensor for it (absent or empty: nothing). Returns
        (peer -> the bytes it sent here, views of one reused buffer valid until the next call;
        the [world, world] size table, the same on every rank). A message to this rank itself is
        handed back without a copy. ``name``: the round (its sizes go first, as
        ``"<name> sizes"``)."""
        world, rank = self.comm.size, self.comm.rank
        sizes = torch.zeros(world, dtype=torch.int64)
        for peer, m in outgoing.items():
            sizes[peer] = m.numel()
        table = self.all_rows(sizes, name + " sizes")
        received = {}
        if outgoing.get(rank) is not None and outgoing[rank].numel():
            received[rank] = outgoing[rank]
        cross = table.clone()
        cross.fill_diagonal_(0)
        if not bool(cross.any()):
            return received, table
        key = tuple(cross.reshape(-1).tolist())
        last = self._payload.get(name)
        if last is None or last[0] != key:
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
            last = self._payload[name] = (key, self._plan(layouts, name), owners)
        _, plan, owners = last
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
