// The cxx bridge's slice overloads (host compiler, with the cxx-generated glue).
#include "host/bridge.h"

#include "groupmm/src/exec/ffi.rs.h"

namespace gmm {

ListPlanned plan_list(const ListRequest& r, rust::Slice<const ListGroup> groups) {
  return plan_list(r, groups.data(), groups.size());
}

void write_list_args(const ListPlan& plan, rust::Slice<uint8_t> host) {
  write_list_args(plan, host.data(), host.size());
}

}  // namespace gmm
