// Index dispatch and combine of MoE tokens, parallel over tokens. Two movements cover all four directions:
// scatter_rows (token rows -> expert buffer rows: the dispatch, and the combine's gradient for the buffer) and
// gather_rows (expert buffer rows -> token rows: the combine, and the dispatch's gradient), each with optional
// per-route float32 weights; route_dots is the combine's gradient for those weights.
// Float32, bfloat16 and float16 data; sums and weights are taken in float32.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "routes.h"

namespace dnv::moe {

// The expert buffer: num_experts blocks of `capacity` rows of `width` elements, held either as one contiguous
// [E, C, M] tensor (`whole`) or as one contiguous tensor of C * M elements per expert (`each`), so experts
// can run on buffers of their own. An undefined tensor in `each` reads as zeros (a gradient nobody produced).
struct Blocks {
    at::Tensor whole;
    std::vector<at::Tensor> each;
    int64_t num_experts = 0;
    int64_t capacity = 0;
    int64_t width = 0;
};

// x[S, M] -> blocks (written, all defined, x's dtype): the row of each kept route (s, j) gets x[s] (times
// weight[s, j] when weight is not null, the product rounded to x's dtype); rows nobody fills are zeroed. With
// `dots`, dots[s * k + j] first gets x[s] . the row's old content (each row belongs to one route, so the
// combine's backward can take its weight dots and overwrite the expert output in one pass).
void scatter_rows(const at::Tensor& x, const RouteRows& routes, int64_t k, const Blocks& blocks,
                  const float* weight, float* dots);

// blocks -> out[S, M] in `dtype`: out[s] = sum over kept j of weight[s, j] * row(s, j) (weight 1 when null),
// summed in float32 in choice order; a token with no kept route gets zeros.
at::Tensor gather_rows(const Blocks& blocks, const RouteRows& routes, int64_t tokens, int64_t k,
                       const float* weight, at::ScalarType dtype);

// grad[S, M], blocks -> [S, k] float32: the dot product of grad[s] and row(s, j), 0 for dropped routes.
at::Tensor route_dots(const at::Tensor& grad, const Blocks& blocks, const RouteRows& routes, int64_t k);

}  // namespace dnv::moe
