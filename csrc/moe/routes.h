// The kept routes of a dispatch/combine: checked once, then read by the gather/scatter kernels.
// Plain C++ on raw arrays (no torch).
#pragma once

#include <cstdint>
#include <vector>

namespace dnv::moe {

// Per route (token * k + choice) the flat buffer row expert * capacity + slot, or -1 when dropped; and per
// buffer row whether a route fills it (the kernels zero only the rows nobody writes).
struct RouteRows {
    std::vector<int64_t> row;
    std::vector<uint8_t> filled;
};

// Throws std::invalid_argument naming the argument when an expert is outside [0, num_experts), a slot
// outside [-1, capacity), or two routes claim the same row (which would make the scatters race).
RouteRows route_rows(const int64_t* expert_idx, const int64_t* slot, int64_t tokens, int64_t k,
                     int64_t num_experts, int64_t capacity);

}  // namespace dnv::moe
