#include "ops/plan_execution.h"

namespace shardgather::detail {

void fill_plan_header(PreflightHeader& header, const PlanFacts& plan, Strategy strategy) {
  header.flags |= kHasHint;
  header.hint_hash = plan.fingerprint;
  set_dtypes(header, plan.dtypes, plan.dtype_hash);
  set_strategy(header, strategy);
}

void finish_job(ExchangeJob& job, const PlanFacts& plan, const Call& call, const ExecScratch& x,
                void* stream) {
  job.shape = plan.shape;
  job.counts = plan.counts;
  job.root = plan.root;
  job.copy_threads = copy_threads(plan.options, call.comm());
  job.entry_synchronized = call.exchanges();
  job.device = x.device;
  job.stream = stream;
}

}  // namespace shardgather::detail
