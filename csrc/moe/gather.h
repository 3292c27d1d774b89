// Index dispatch and combine of MoE tokens, parallel over tokens. Two movements cover all four directions:
// scatter_rows (token rows -> expert buffer rows: the dispatch, and the combine's gradient for the buffer) and
// gather_rows (expert buffer rows -> token rows: the combine, and the dispatch's gradient), each with optional
// per-route float32 weights; route_dots is the combine's gradient for those weights, and
// scatter_rows_over both of the combine's gradients computed in the expert buffer's own memory.
// Float32, bfloat16 and float16 data; sums and weights are taken in float32.
#pragma once

#include <ATen/core/Tensor.h>

#include "routes.h"

namespace dnv::moe {

// x[S, M] -> [E, C, M] in x's dtype: the row of each kept route (s, j) gets x[s] (times weight[s, j] when
// weight is not null, the product rounded to x's dtype); rows nobody fills are zero.
at::Tensor scatter_rows(const at::Tensor& x, const RouteRows& routes, int64_t k, int64_t num_experts,
                        int64_t capacity, const float* weight);

// y[E, C, M] -> out[S, M] in y's dtype: out[s] = sum over kept j of weight[s, j] * y[row(s, j)] (weight 1 when
// null), summed in float32 in choice order; a token with no kept route gets zeros.
at::Tensor gather_rows(const at::Tensor& y, const RouteRows& routes, int64_t tokens, int64_t k,
                       const float* weight);

// grad[S, M], y[E, C, M] -> [S, k] float32: the dot product of grad[s] and y[row(s, j)], 0 for dropped routes.
at::Tensor route_dots(const at::Tensor& grad, const at::Tensor& y, const RouteRows& routes, int64_t tokens,
                      int64_t k);

// The combine's backward written over its input: for each kept route (s, j), dots[s * k + j] = grad[s] . y[row]
// (when dots is not null) and then y[row] = grad[s] * weight[s, j] (rounded to y's dtype); rows nobody fills are
// zeroed. Each row belongs to one route, so reading it before overwriting it is safe. The caller must own y.
void scatter_rows_over(at::Tensor& y, const at::Tensor& grad, const RouteRows& routes, int64_t k,
                       const float* weight, float* dots);

}  // namespace dnv::moe
