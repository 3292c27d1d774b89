// Capacity slot assignment for MoE routes (see slots.h).
#include "slots.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

namespace dnv::moe {
namespace {

// One candidate for a row: its priority, its place in slot order and where its answer goes.
struct Candidate {
    float priority;
    int64_t order;
    int64_t route;  // token * k + choice
};

// "a is kept before b": higher priority first, ties to the earlier route in slot order.
bool better(const Candidate& a, const Candidate& b) {
    return a.priority > b.priority || (a.priority == b.priority && a.order < b.order);
}

// Heap comparator putting the *worst* kept candidate on top, so it is the one a better newcomer evicts.
bool heap_less(const Candidate& a, const Candidate& b) { return better(a, b); }

int64_t checked_expert(const SlotRequest& req, int64_t route) {
    const int64_t e = req.expert_idx[route];
    if (e < 0 || e >= req.num_experts) {
        throw std::invalid_argument("expert_idx holds " + std::to_string(e) + " at token " +
                                    std::to_string(route / req.k) + ", outside [0, " +
                                    std::to_string(req.num_experts) + ")");
    }
    return e;
}

// Visits the routes in slot order, calling fn(order, route).
template <typename Fn>
void for_each_route(const SlotRequest& req, Fn&& fn) {
    int64_t order = 0;
    if (req.choice_major) {
        for (int64_t j = 0; j < req.k; ++j)
            for (int64_t s = 0; s < req.tokens; ++s) fn(order++, s * req.k + j);
    } else {
        for (int64_t r = 0; r < req.tokens * req.k; ++r) fn(order++, r);
    }
}

}  // namespace

void assign_slots(const SlotRequest& req, int64_t* slot, int64_t* counts) {
    std::fill(counts, counts + req.num_experts, int64_t{0});
    const int64_t routes = req.tokens * req.k;
    std::fill(slot, slot + routes, int64_t{-1});
    if (req.priority == nullptr || req.capacity < 0) {
        // First come, first kept: a route's rank in its expert is the count of routes before it.
        for_each_route(req, [&](int64_t, int64_t r) {
            if (req.active != nullptr && !req.active[r]) return;
            const int64_t e = checked_expert(req, r);
            const int64_t rank = counts[e]++;
            if (req.capacity < 0 || rank < req.capacity) slot[r] = rank;
        });
        return;
    }
    const auto cap = static_cast<size_t>(req.capacity);
    std::vector<std::vector<Candidate>> kept(static_cast<size_t>(req.num_experts));
    for_each_route(req, [&](int64_t order, int64_t r) {
        if (req.active != nullptr && !req.active[r]) return;
        const int64_t e = checked_expert(req, r);
        const float p = req.priority[r];
        if (std::isnan(p)) {
            throw std::invalid_argument("priority holds NaN at token " + std::to_string(r / req.k));
        }
        ++counts[e];
        if (cap == 0) return;
        auto& heap = kept[static_cast<size_t>(e)];
        const Candidate c{p, order, r};
        if (heap.size() < cap) {
            heap.push_back(c);
            std::push_heap(heap.begin(), heap.end(), heap_less);
        } else if (better(c, heap.front())) {
            std::pop_heap(heap.begin(), heap.end(), heap_less);
            heap.back() = c;
            std::push_heap(heap.begin(), heap.end(), heap_less);
        }
    });
    // The survivors take rows 0, 1, ... in slot order, as DeepSpeed's cumsum after the drop gives them.
    for (auto& heap : kept) {
        std::sort(heap.begin(), heap.end(), [](const Candidate& a, const Candidate& b) { return a.order < b.order; });
        for (size_t i = 0; i < heap.size(); ++i) slot[heap[i].route] = static_cast<int64_t>(i);
    }
}

}  // namespace dnv::moe
