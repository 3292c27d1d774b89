// Capacity slots of MoE routes: which row of its expert's buffer each (token, choice) takes, or -1.
// Plain C++ on raw arrays (no torch): the binding checks tensors and hands their data over.
#pragma once

#include <cstdint>

namespace dnv::moe {

struct SlotRequest {
    const int64_t* expert_idx = nullptr;  // [tokens, k], row-major, each in [0, num_experts)
    int64_t tokens = 0;
    int64_t k = 0;
    int64_t num_experts = 0;
    int64_t capacity = -1;              // -1: keep every route
    const float* priority = nullptr;    // [tokens, k] or null; higher is kept first
    const bool* active = nullptr;       // [tokens, k] or null; inactive routes are neither counted nor kept
    bool choice_major = true;           // slot order: all first choices, then all second, ... (else token-major)
};

// Writes slot[tokens * k] (-1 = dropped or inactive) and counts[num_experts] (routes before dropping).
// One pass over the routes in slot order; with a priority each expert keeps a bounded heap of its best
// `capacity` routes, and the survivors are numbered in slot order at the end. Throws std::invalid_argument
// for an out-of-range expert or a NaN priority.
void assign_slots(const SlotRequest& req, int64_t* slot, int64_t* counts);

}  // namespace dnv::moe
