// Index dispatch and combine of MoE tokens, forward and backward, parallel over tokens.
// Float32, bfloat16 and float16 data; sums and weights are taken in float32.
#pragma once

#include <ATen/core/Tensor.h>

#include <utility>

#include "routes.h"

namespace dnv::moe {

// x[S, M] -> [E, C, M]: each kept route copies its token into its row; rows nobody fills are zero.
at::Tensor dispatch_forward(const at::Tensor& x, const RouteRows& routes, int64_t k, int64_t num_experts,
                            int64_t capacity);

// grad[E, C, M] -> grad_x[S, M]: each token sums (in float32, choice order) the rows its kept routes filled.
at::Tensor dispatch_backward(const at::Tensor& grad, const RouteRows& routes, int64_t tokens, int64_t k);

// y[E, C, M], weight[S, k] (float32) -> out[S, M] in y's dtype: sum over kept j of weight * row, in
// float32 and choice order.
at::Tensor combine_forward(const at::Tensor& y, const RouteRows& routes, const at::Tensor& weight);

// The gradients of combine_forward: grad_y[E, C, M] (y's dtype, zero rows where empty) and grad_weight[S, k]
// (float32, zero for dropped routes); either may be skipped (undefined tensor).
std::pair<at::Tensor, at::Tensor> combine_backward(const at::Tensor& grad, const at::Tensor& y,
                                                   const RouteRows& routes, const at::Tensor& weight,
                                                   bool need_y, bool need_weight);

}  // namespace dnv::moe
