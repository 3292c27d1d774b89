// How one tensor request is cut up: per-thread slices of an aligned body that can go O_DIRECT,
// and the unaligned head and tail that must go through the page cache.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "file.h"

namespace dnv {

// Byte ranges relative to the start of the request. Empty ranges have begin == end.
struct SlicePlan {
    size_t head_begin = 0, head_end = 0;  // buffered, before the body (first slice only)
    size_t body_begin = 0, body_end = 0;  // through the engine in blocks
    size_t tail_begin = 0, tail_end = 0;  // buffered, after the body (last slice only)
};

struct RequestPlan {
    std::vector<SlicePlan> slices;
    bool staged = false;  // body goes through staging buffers (memory not aligned for O_DIRECT)
    bool has_edges = false;
};

// direct: an O_DIRECT descriptor is available. host_memory: false for device memory (always staged).
// Slices are cut at multiples of the page size (and of the device alignment) so that two threads never
// share a page and buffered edges never share one with another thread's direct I/O. A slice is at least
// min_slice bytes (the tunable of that name): below it another thread costs more than it brings.
RequestPlan plan_request(uintptr_t mem, size_t nbytes, uint64_t file_offset, bool direct, bool host_memory,
                         const Alignment& align, unsigned parallelism, size_t min_slice);

}  // namespace dnv
