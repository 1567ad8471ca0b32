// The umbrella header: what most users include. The MPI backend is in shardgather/mpi.h.
#pragma once

#include "shardgather/buffer.h"
#include "shardgather/communicator.h"
#include "shardgather/device_allocator.h"
#include "shardgather/embedding.h"
#include "shardgather/errors.h"
#include "shardgather/foreach_all_gather.h"
#include "shardgather/layout.h"
#include "shardgather/plan.h"
#include "shardgather/stats.h"
#include "shardgather/strategy.h"
#include "shardgather/threads.h"
#include "shardgather/types.h"
#include "shardgather/unshard.h"
#include "shardgather/unshard_stream.h"
#include "shardgather/version.h"
#include "shardgather/work.h"
