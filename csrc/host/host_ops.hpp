// CPU operations on a Communicator beyond its collective methods (include/commlib/communicator.hpp):
// the routing check of the torch backend. Collective unless stated otherwise.
#pragma once

#include <cstddef>
#include <cstdint>

#include "commlib/communicator.hpp"

namespace commlib::host {

// Every rank states the call it is about to make (kind, dtype code, element count and reduction, as
// the caller encodes them); returns when all stated the same, and raises PeerError ("ranks disagree
// ...") on every rank otherwise. The group stays usable either way. One shared-memory round.
void agree(Communicator& comm, const char* what, uint32_t kind, uint32_t dtype_code, uint64_t count, uint32_t reduction);

// `root` receives world_size blocks of `bytes` in `out` (rank order; ignored elsewhere), block r
// being rank r's `in`.
void gather(Communicator& comm, void* out, const void* in, size_t bytes, int root);
// Rank r receives block r of root's `in` (world_size blocks of `bytes`; ignored elsewhere) in `out`.
void scatter(Communicator& comm, void* out, const void* in, size_t bytes, int root);

}  // namespace commlib::host
