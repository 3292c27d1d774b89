// Checking the routes of a dispatch/combine and mapping them to buffer rows (see routes.h).
#include "routes.h"

#include <stdexcept>
#include <string>

namespace dnv::moe {

RouteRows route_rows(const int64_t* expert_idx, const int64_t* slot, int64_t tokens, int64_t k,
                     int64_t num_experts, int64_t capacity) {
    RouteRows out;
    const int64_t routes = tokens * k;
    out.row.assign(static_cast<size_t>(routes), -1);
    out.filled.assign(static_cast<size_t>(num_experts * capacity), 0);
    for (int64_t r = 0; r < routes; ++r) {
        const int64_t e = expert_idx[r];
        const int64_t c = slot[r];
        if (e < 0 || e >= num_experts) {
            throw std::invalid_argument("expert_idx holds " + std::to_string(e) + " at token " +
                                        std::to_string(r / k) + ", outside [0, " + std::to_string(num_experts) +
                                        ")");
        }
        if (c < -1 || c >= capacity) {
            throw std::invalid_argument("slot holds " + std::to_string(c) + " at token " + std::to_string(r / k) +
                                        ", outside [-1, " + std::to_string(capacity) + ")");
        }
        if (c < 0) continue;
        const int64_t row = e * capacity + c;
        if (out.filled[static_cast<size_t>(row)]) {
            throw std::invalid_argument("slot: two routes share expert " + std::to_string(e) + " row " +
                                        std::to_string(c) + " (token " + std::to_string(r / k) + ")");
        }
        out.filled[static_cast<size_t>(row)] = 1;
        out.row[static_cast<size_t>(r)] = row;
    }
    return out;
}

}  // namespace dnv::moe
