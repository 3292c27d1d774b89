// Top-k expert choices per token (see topk.h): one insertion pass over each row, k small next to experts.
#include "topk.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace dnv::moe {

void top_k(const float* scores, int64_t tokens, int64_t experts, int64_t k, int64_t* index, float* value) {
    if (k < 1 || k > experts) {
        throw std::invalid_argument("k must be in [1, " + std::to_string(experts) + "], got " + std::to_string(k));
    }
    const int64_t grain = std::max<int64_t>(1, 16384 / experts);
    at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
        for (int64_t s = begin; s < end; ++s) {
            const float* row = scores + s * experts;
            int64_t* idx = index + s * k;
            float* val = value + s * k;
            int64_t filled = 0;
            for (int64_t e = 0; e < experts; ++e) {
                const float v = row[e];
                if (std::isnan(v)) {
                    throw std::invalid_argument("scores holds NaN at token " + std::to_string(s));
                }
                // Strictly greater: an equal score never displaces the lower index found earlier.
                if (filled == k && !(v > val[k - 1])) continue;
                int64_t pos = filled < k ? filled++ : k - 1;
                while (pos > 0 && v > val[pos - 1]) {
                    val[pos] = val[pos - 1];
                    idx[pos] = idx[pos - 1];
                    --pos;
                }
                val[pos] = v;
                idx[pos] = e;
            }
        }
    });
}

}  // namespace dnv::moe
