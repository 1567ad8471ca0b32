// `shardgather-bench reshard`: a trainer's FSDP shards (ranks 0..M-1) resharded into an inference
// engine's tensor-parallel layout (ranks M.., TP t x R replicas), by ReshardPlan and, under MPI,
// by the anchors' methods over the same transport: (a) gather to rank 0 then broadcast, each
// destination slicing locally; (b) owner-rotating broadcast; (c) one send/recv per overlapping
// slice. Reports each method's median time (slowest rank), the bytes each destination received
// against the bytes of its boxes (counted by the transport), and the link floor (max over hosts
// of bytes in or out / a measured link rate). docs/benchmarking.md, "Reshard".
#pragma once

namespace shardgather::bench {

// argv[0] is "reshard"; returns the exit code (2 for a bad command line, 1 for a wrong byte).
int reshard_main(int argc, char** argv);

}  // namespace shardgather::bench
