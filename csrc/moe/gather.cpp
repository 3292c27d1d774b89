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

// The first element of each block's rows (null for an undefined block, which reads as zeros).
template <typename T>
std::vector<T*> block_starts(const Blocks& b) {
    std::vector<T*> starts(static_cast<size_t>(b.num_experts), nullptr);
    for (int64_t e = 0; e < b.num_experts; ++e) {
        const at::Tensor& t = b.whole.defined() ? b.whole : b.each[static_cast<size_t>(e)];
        if (!t.defined()) continue;
        T* base = static_cast<T*>(t.data_ptr());
        starts[static_cast<size_t>(e)] = b.whole.defined() ? base + e * b.capacity * b.width : base;
    }
    return starts;
}

// Row r of the buffer (expert r / C, slot r % C), or null inside an undefined block.
template <typename T>
T* row_at(const std::vector<T*>& starts, const Blocks& b, int64_t r) {
    T* start = starts[static_cast<size_t>(r / b.capacity)];
    return start == nullptr ? nullptr : start + (r % b.capacity) * b.width;
}

}  // namespace

void scatter_rows(const at::Tensor& x, const RouteRows& routes, int64_t k, const Blocks& blocks,
                  const float* weight, float* dots) {
    const int64_t tokens = x.size(0), width = blocks.width;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "moe_scatter_rows", [&] {
        const scalar_t* src = x.const_data_ptr<scalar_t>();
        const std::vector<scalar_t*> starts = block_starts<scalar_t>(blocks);
        at::parallel_for(0, tokens, token_grain(width * k), [&](int64_t begin, int64_t end) {
            for (int64_t s = begin; s < end; ++s) {
                const scalar_t* xs = src + s * width;
                for (int64_t j = 0; j < k; ++j) {
                    const int64_t route = s * k + j;
                    const int64_t row = routes.row[static_cast<size_t>(route)];
                    if (row < 0) continue;
                    scalar_t* d = row_at(starts, blocks, row);
                    if (dots != nullptr) dots[route] = dot(xs, d, width);
                    if (weight == nullptr) {
                        std::memcpy(d, xs, sizeof(scalar_t) * width);
                        continue;
                    }
                    const float ws = weight[route];
                    for (int64_t m = 0; m < width; ++m) d[m] = static_cast<scalar_t>(static_cast<float>(xs[m]) * ws);
                }
            }
        });
        const auto rows = static_cast<int64_t>(routes.filled.size());
        at::parallel_for(0, rows, token_grain(width), [&](int64_t begin, int64_t end) {
            for (int64_t r = begin; r < end; ++r) {
                if (routes.filled[static_cast<size_t>(r)]) continue;
                scalar_t* d = row_at(starts, blocks, r);
                std::fill(d, d + width, scalar_t(0));
            }
        });
    });
}

at::Tensor gather_rows(const Blocks& blocks, const RouteRows& routes, int64_t tokens, int64_t k,
                       const float* weight, at::ScalarType dtype) {
    const int64_t width = blocks.width;
    at::Tensor out = at::empty({tokens, width}, at::TensorOptions().dtype(dtype));
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "moe_gather_rows", [&] {
        const std::vector<scalar_t*> starts = block_starts<scalar_t>(blocks);
        scalar_t* dst = out.mutable_data_ptr<scalar_t>();
        at::parallel_for(0, tokens, token_grain(width * k), [&](int64_t begin, int64_t end) {
            std::vector<float> acc(k > 1 ? static_cast<size_t>(width) : 0);
            for (int64_t s = begin; s < end; ++s) {
                scalar_t* o = dst + s * width;
                if (k == 1) {
                    // One route: its weighted row is the sum; 0.0f + part keeps the accumulator's bits (-0 -> +0).
                    const int64_t row = routes.row[static_cast<size_t>(s)];
                    const scalar_t* src = row < 0 ? nullptr : row_at(starts, blocks, row);
                    if (src == nullptr) {
                        std::fill(o, o + width, scalar_t(0));
                        continue;
                    }
                    const float ws = weight == nullptr ? 1.0f : weight[s];
                    for (int64_t m = 0; m < width; ++m) {
                        const float part = static_cast<float>(src[m]) * ws;
                        o[m] = static_cast<scalar_t>(0.0f + part);
                    }
                    continue;
                }
                std::fill(acc.begin(), acc.end(), 0.0f);
                for (int64_t j = 0; j < k; ++j) {
                    const int64_t route = s * k + j;
                    const int64_t row = routes.row[static_cast<size_t>(route)];
                    const scalar_t* src = row < 0 ? nullptr : row_at(starts, blocks, row);
                    if (src == nullptr) continue;
                    const float ws = weight == nullptr ? 1.0f : weight[route];
                    // A product rounded on its own, then added: the same two roundings as the torch path.
                    for (int64_t m = 0; m < width; ++m) {
                        const float part = static_cast<float>(src[m]) * ws;
                        acc[m] += part;
                    }
                }
                for (int64_t m = 0; m < width; ++m) o[m] = static_cast<scalar_t>(acc[m]);
            }
        });
    });
    return out;
}

at::Tensor route_dots(const at::Tensor& grad, const Blocks& blocks, const RouteRows& routes, int64_t k) {
    const int64_t tokens = grad.size(0), width = blocks.width;
    at::Tensor dots = at::zeros({tokens, k}, grad.options().dtype(at::kFloat));
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad.scalar_type(), "moe_route_dots", [&] {
        const scalar_t* g = grad.const_data_ptr<scalar_t>();
        const std::vector<scalar_t*> starts = block_starts<scalar_t>(blocks);
        float* d = dots.mutable_data_ptr<float>();
        at::parallel_for(0, tokens, token_grain(width * k), [&](int64_t begin, int64_t end) {
            for (int64_t s = begin; s < end; ++s) {
                for (int64_t j = 0; j < k; ++j) {
                    const int64_t row = routes.row[static_cast<size_t>(s * k + j)];
                    const scalar_t* src = row < 0 ? nullptr : row_at(starts, blocks, row);
                    if (src != nullptr) d[s * k + j] = dot(g + s * width, src, width);
                }
            }
        });
    });
    return dots;
}

}  // namespace dnv::moe
