// Index dispatch/combine kernels (see gather.h). Every kernel splits tokens over the intra-op threads; the
// scatters are race-free because route_rows() has guaranteed that no two routes share a row.
#include "gather.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace dnv::moe {
namespace {

// Enough work per task that thread hand-off stays small next to the copying.
int64_t token_grain(int64_t width) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(width, 1)); }

// Zero the rows of a [rows, width] buffer that no route writes, in parallel.
template <typename T>
void zero_empty_rows(T* data, const std::vector<uint8_t>& filled, int64_t width) {
    const auto rows = static_cast<int64_t>(filled.size());
    at::parallel_for(0, rows, token_grain(width), [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            if (!filled[static_cast<size_t>(r)]) std::fill(data + r * width, data + (r + 1) * width, T(0));
        }
    });
}

// Float dot product over independent lanes: the compiler vectorises the lanes (a single running sum it may
// not reorder), and the lanes are added in double at the end.
template <typename T>
float dot(const T* a, const T* b, int64_t n) {
    constexpr int64_t kLanes = 16;
    float lanes[kLanes] = {};
    int64_t m = 0;
    for (; m + kLanes <= n; m += kLanes) {
        for (int64_t l = 0; l < kLanes; ++l) lanes[l] += static_cast<float>(a[m + l]) * static_cast<float>(b[m + l]);
    }
    double total = 0.0;
    for (; m < n; ++m) total += static_cast<double>(static_cast<float>(a[m]) * static_cast<float>(b[m]));
    for (float lane : lanes) total += lane;
    return static_cast<float>(total);
}

}  // namespace

at::Tensor dispatch_forward(const at::Tensor& x, const RouteRows& routes, int64_t k, int64_t num_experts,
                            int64_t capacity) {
    const int64_t tokens = x.size(0), width = x.size(1);
    at::Tensor out = at::empty({num_experts, capacity, width}, x.options());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "moe_dispatch_forward", [&] {
        const scalar_t* src = x.const_data_ptr<scalar_t>();
        scalar_t* dst = out.mutable_data_ptr<scalar_t>();
        at::parallel_for(0, tokens, token_grain(width * k), [&](int64_t begin, int64_t end) {
            for (int64_t s = begin; s < end; ++s) {
                for (int64_t j = 0; j < k; ++j) {
                    const int64_t row = routes.row[static_cast<size_t>(s * k + j)];
                    if (row >= 0) std::memcpy(dst + row * width, src + s * width, sizeof(scalar_t) * width);
                }
            }
        });
        zero_empty_rows(dst, routes.filled, width);
    });
    return out;
}

at::Tensor dispatch_backward(const at::Tensor& grad, const RouteRows& routes, int64_t tokens, int64_t k) {
    const int64_t width = grad.size(2);
    at::Tensor grad_x = at::empty({tokens, width}, grad.options());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad.scalar_type(), "moe_dispatch_backward", [&] {
        const scalar_t* g = grad.const_data_ptr<scalar_t>();
        scalar_t* dst = grad_x.mutable_data_ptr<scalar_t>();
        at::parallel_for(0, tokens, token_grain(width * k), [&](int64_t begin, int64_t end) {
            std::vector<float> acc(static_cast<size_t>(width));
            for (int64_t s = begin; s < end; ++s) {
                std::fill(acc.begin(), acc.end(), 0.0f);
                for (int64_t j = 0; j < k; ++j) {
                    const int64_t row = routes.row[static_cast<size_t>(s * k + j)];
                    if (row < 0) continue;
                    const scalar_t* src = g + row * width;
                    for (int64_t m = 0; m < width; ++m) acc[m] += static_cast<float>(src[m]);
                }
                scalar_t* out = dst + s * width;
                for (int64_t m = 0; m < width; ++m) out[m] = static_cast<scalar_t>(acc[m]);
            }
        });
    });
    return grad_x;
}

at::Tensor combine_forward(const at::Tensor& y, const RouteRows& routes, const at::Tensor& weight) {
    const int64_t tokens = weight.size(0), k = weight.size(1), width = y.size(2);
    at::Tensor out = at::empty({tokens, width}, y.options());
    const float* w = weight.const_data_ptr<float>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "moe_combine_forward", [&] {
        const scalar_t* rows = y.const_data_ptr<scalar_t>();
        scalar_t* dst = out.mutable_data_ptr<scalar_t>();
        at::parallel_for(0, tokens, token_grain(width * k), [&](int64_t begin, int64_t end) {
            std::vector<float> acc(static_cast<size_t>(width));
            for (int64_t s = begin; s < end; ++s) {
                std::fill(acc.begin(), acc.end(), 0.0f);
                for (int64_t j = 0; j < k; ++j) {
                    const int64_t row = routes.row[static_cast<size_t>(s * k + j)];
                    if (row < 0) continue;
                    const float ws = w[s * k + j];
                    const scalar_t* src = rows + row * width;
                    // A product rounded on its own, then added: the same two roundings as the torch path.
                    for (int64_t m = 0; m < width; ++m) {
                        const float part = static_cast<float>(src[m]) * ws;
                        acc[m] += part;
                    }
                }
                scalar_t* o = dst + s * width;
                for (int64_t m = 0; m < width; ++m) o[m] = static_cast<scalar_t>(acc[m]);
            }
        });
    });
    return out;
}

std::pair<at::Tensor, at::Tensor> combine_backward(const at::Tensor& grad, const at::Tensor& y,
                                                   const RouteRows& routes, const at::Tensor& weight,
                                                   bool need_y, bool need_weight) {
    const int64_t tokens = weight.size(0), k = weight.size(1), width = y.size(2);
    at::Tensor grad_y, grad_w;
    if (need_y) grad_y = at::empty(y.sizes(), y.options());
    if (need_weight) grad_w = at::zeros({tokens, k}, weight.options());
    const float* w = weight.const_data_ptr<float>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "moe_combine_backward", [&] {
        const scalar_t* g = grad.const_data_ptr<scalar_t>();
        const scalar_t* rows = y.const_data_ptr<scalar_t>();
        scalar_t* gy = need_y ? grad_y.mutable_data_ptr<scalar_t>() : nullptr;
        float* gw = need_weight ? grad_w.mutable_data_ptr<float>() : nullptr;
        at::parallel_for(0, tokens, token_grain(width * k), [&](int64_t begin, int64_t end) {
            for (int64_t s = begin; s < end; ++s) {
                const scalar_t* gs = g + s * width;
                for (int64_t j = 0; j < k; ++j) {
                    const int64_t row = routes.row[static_cast<size_t>(s * k + j)];
                    if (row < 0) continue;
                    if (gy != nullptr) {
                        const float ws = w[s * k + j];
                        scalar_t* dst = gy + row * width;
                        for (int64_t m = 0; m < width; ++m) {
                            dst[m] = static_cast<scalar_t>(static_cast<float>(gs[m]) * ws);
                        }
                    }
                    if (gw != nullptr) {
                        const scalar_t* src = rows + row * width;
                        gw[s * k + j] = dot(gs, src, width);
                    }
                }
            }
        });
        if (gy != nullptr) zero_empty_rows(gy, routes.filled, width);
    });
    return {grad_y, grad_w};
}

}  // namespace dnv::moe
