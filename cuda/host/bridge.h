// What the cxx bridge of src/exec/ffi.rs includes: the C++ API (host/api.h, with the
// complete plan types the bridge holds as opaque types, and the enums of
// device/types.h), plus the two overloads that take cxx slices.
#pragma once
#include "device/types.h"
#include "host/api.h"
#include "rust/cxx.h"

namespace gmm {

ListPlanned plan_list(const ListRequest& r, rust::Slice<const ListGroup> groups);
void write_list_args(const ListPlan& plan, rust::Slice<uint8_t> host);

}  // namespace gmm
