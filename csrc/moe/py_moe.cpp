// Python binding of the moe op: checks tensors (TypeError/ValueError naming the argument) and hands raw
// data to the routing code. The only moe file that includes torch/extension.h.
#include <torch/extension.h>

#include <optional>
#include <string>
#include <tuple>

#include "gather.h"
#include "routes.h"
#include "slots.h"
#include "topk.h"

namespace dnv::moe {
namespace {

void check_cpu(const at::Tensor& t, const char* name) {
    TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
}

// [S, k] int64/int32 indices as a contiguous int64 tensor.
at::Tensor index_tensor(const at::Tensor& t, const char* name) {
    check_cpu(t, name);
    TORCH_CHECK_TYPE(t.scalar_type() == at::kLong || t.scalar_type() == at::kInt, name,
                     " must be an int64 or int32 tensor, got ", t.scalar_type());
    TORCH_CHECK_VALUE(t.dim() == 2, name, " must be 2-D [S, k], got ", t.sizes());
    return t.to(at::kLong).contiguous();
}

void check_data(const at::Tensor& t, const char* name, int64_t dim) {
    check_cpu(t, name);
    const auto st = t.scalar_type();
    TORCH_CHECK_TYPE(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf, name,
                     " must be float32, bfloat16 or float16, got ", st);
    TORCH_CHECK_VALUE(t.dim() == dim, name, " must be ", dim, "-D, got ", t.sizes());
}

at::Tensor weight_tensor(const at::Tensor& w, const at::Tensor& idx) {
    check_cpu(w, "weight");
    TORCH_CHECK_TYPE(at::isFloatingType(w.scalar_type()), "weight must be a floating tensor, got ", w.scalar_type());
    TORCH_CHECK_VALUE(w.sizes() == idx.sizes(), "weight must have expert_idx's shape ", idx.sizes(), ", got ",
                      w.sizes());
    return w.to(at::kFloat).contiguous();
}

RouteRows rows_of(const at::Tensor& idx, const at::Tensor& slot, int64_t num_experts, int64_t capacity) {
    TORCH_CHECK_VALUE(slot.sizes() == idx.sizes(), "slot must have expert_idx's shape ", idx.sizes(), ", got ",
                      slot.sizes());
    return route_rows(idx.const_data_ptr<int64_t>(), slot.const_data_ptr<int64_t>(), idx.size(0), idx.size(1),
                      num_experts, capacity);
}

std::tuple<at::Tensor, at::Tensor> py_assign_slots(const at::Tensor& expert_idx, int64_t num_experts,
                                                   int64_t capacity, const std::optional<at::Tensor>& priority,
                                                   const std::optional<at::Tensor>& active, bool choice_major) {
    const at::Tensor idx = index_tensor(expert_idx, "expert_idx");
    TORCH_CHECK_VALUE(num_experts >= 1, "num_experts must be >= 1, got ", num_experts);
    TORCH_CHECK_VALUE(capacity >= -1, "capacity must be >= 0 (or -1 for none), got ", capacity);
    SlotRequest req;
    req.expert_idx = idx.const_data_ptr<int64_t>();
    req.tokens = idx.size(0);
    req.k = idx.size(1);
    req.num_experts = num_experts;
    req.capacity = capacity;
    req.choice_major = choice_major;
    at::Tensor prio, act;
    if (priority.has_value()) {
        check_cpu(*priority, "priority");
        TORCH_CHECK_TYPE(at::isFloatingType(priority->scalar_type()), "priority must be a floating tensor, got ",
                         priority->scalar_type());
        TORCH_CHECK_VALUE(priority->sizes() == idx.sizes(), "priority must have expert_idx's shape ", idx.sizes(),
                          ", got ", priority->sizes());
        prio = priority->to(at::kFloat).contiguous();
        req.priority = prio.const_data_ptr<float>();
    }
    if (active.has_value()) {
        check_cpu(*active, "active");
        TORCH_CHECK_TYPE(active->scalar_type() == at::kBool, "active must be a bool tensor, got ",
                         active->scalar_type());
        TORCH_CHECK_VALUE(active->sizes() == idx.sizes(), "active must have expert_idx's shape ", idx.sizes(),
                          ", got ", active->sizes());
        act = active->contiguous();
        req.active = act.const_data_ptr<bool>();
    }
    at::Tensor slot = at::empty(idx.sizes(), idx.options());
    at::Tensor counts = at::empty({num_experts}, idx.options());
    assign_slots(req, slot.mutable_data_ptr<int64_t>(), counts.mutable_data_ptr<int64_t>());
    return {slot, counts};
}

// The optional per-route weights as contiguous float32 (kept alive by the returned tensor), or undefined.
at::Tensor optional_weight(const std::optional<at::Tensor>& weight, const at::Tensor& idx) {
    return weight.has_value() ? weight_tensor(*weight, idx) : at::Tensor();
}

const float* data_or_null(const at::Tensor& w) { return w.defined() ? w.const_data_ptr<float>() : nullptr; }

// The expert buffer handed over as a list: one [E, C, M] tensor, or one tensor of C * M elements per expert
// (None allowed where `allow_missing`: a block of zeros). Every block must be contiguous, of one dtype.
Blocks blocks_of(const std::vector<std::optional<at::Tensor>>& list, int64_t num_experts, int64_t capacity,
                 bool allow_missing) {
    TORCH_CHECK_VALUE(num_experts >= 1, "num_experts must be >= 1, got ", num_experts);
    TORCH_CHECK_VALUE(capacity >= 0, "capacity must be >= 0, got ", capacity);
    Blocks b;
    b.num_experts = num_experts;
    b.capacity = capacity;
    std::optional<at::ScalarType> dtype;
    auto check = [&](const at::Tensor& t) {
        check_cpu(t, "blocks");
        const auto st = t.scalar_type();
        TORCH_CHECK_TYPE(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf,
                         "blocks must be float32, bfloat16 or float16, got ", st);
        TORCH_CHECK_TYPE(!dtype.has_value() || *dtype == st, "blocks must share one dtype, got ", *dtype, " and ", st);
        TORCH_CHECK_VALUE(t.is_contiguous(), "blocks must be contiguous");
        dtype = st;
    };
    if (list.size() == 1 && list[0].has_value() && list[0]->dim() == 3) {
        b.whole = *list[0];
        check(b.whole);
        TORCH_CHECK_VALUE(b.whole.size(0) == num_experts && b.whole.size(1) == capacity, "blocks must be [",
                          num_experts, ", ", capacity, ", M], got ", b.whole.sizes());
        b.width = b.whole.size(2);
        return b;
    }
    TORCH_CHECK_VALUE(static_cast<int64_t>(list.size()) == num_experts, "blocks must hold one [E, C, M] tensor or ",
                      num_experts, " per-expert tensors, got ", list.size());
    b.width = -1;
    for (const auto& t : list) {
        if (!t.has_value()) {
            TORCH_CHECK_VALUE(allow_missing, "blocks must all be tensors here");
            b.each.emplace_back();
            continue;
        }
        check(*t);
        TORCH_CHECK_VALUE(t->dim() >= 1, "blocks must not be 0-D");
        if (b.width < 0) b.width = t->size(-1);
        TORCH_CHECK_VALUE(t->size(-1) == b.width && t->numel() == capacity * b.width,
                          "blocks: every block must hold ", capacity, " rows of width ", b.width, ", got ", t->sizes());
        b.each.push_back(*t);
    }
    TORCH_CHECK_VALUE(b.width >= 0, "blocks must hold at least one tensor");
    return b;
}

at::ScalarType dtype_of(const Blocks& b) {
    if (b.whole.defined()) return b.whole.scalar_type();
    for (const auto& t : b.each)
        if (t.defined()) return t.scalar_type();
    return at::kFloat;
}

// The checked routes of a dispatch of x [S, M]: expert_idx as the op's index tensor, one row per token.
at::Tensor checked_dispatch_index(const at::Tensor& x, const at::Tensor& expert_idx, int64_t num_experts,
                                  int64_t capacity) {
    check_data(x, "x", 2);
    const at::Tensor idx = index_tensor(expert_idx, "expert_idx");
    TORCH_CHECK_VALUE(num_experts >= 1, "num_experts must be >= 1, got ", num_experts);
    TORCH_CHECK_VALUE(capacity >= 0, "capacity must be >= 0, got ", capacity);
    TORCH_CHECK_VALUE(idx.size(0) == x.size(0), "expert_idx must have ", x.size(0), " rows (one per token), got ",
                      idx.size(0));
    return idx;
}

// Blocks of num_experts x capacity rows of `width`, their tensors still to be attached.
Blocks empty_blocks(int64_t num_experts, int64_t capacity, int64_t width) {
    Blocks b;
    b.num_experts = num_experts;
    b.capacity = capacity;
    b.width = width;
    return b;
}

at::Tensor py_scatter(const at::Tensor& x, const at::Tensor& expert_idx, const at::Tensor& slot, int64_t num_experts,
                      int64_t capacity, const std::optional<at::Tensor>& weight) {
    const at::Tensor idx = checked_dispatch_index(x, expert_idx, num_experts, capacity);
    const at::Tensor w = optional_weight(weight, idx);
    const RouteRows routes = rows_of(idx, index_tensor(slot, "slot"), num_experts, capacity);
    Blocks b = empty_blocks(num_experts, capacity, x.size(1));
    b.whole = at::empty({num_experts, capacity, x.size(1)}, x.options());
    scatter_rows(x.contiguous(), routes, idx.size(1), b, data_or_null(w), nullptr);
    return b.whole;
}

std::vector<at::Tensor> py_scatter_blocks(const at::Tensor& x, const at::Tensor& expert_idx, const at::Tensor& slot,
                                          int64_t num_experts, int64_t capacity, at::IntArrayRef block_shape) {
    const at::Tensor idx = checked_dispatch_index(x, expert_idx, num_experts, capacity);
    TORCH_CHECK_VALUE(c10::multiply_integers(block_shape) == capacity * x.size(1) && !block_shape.empty() &&
                          block_shape.back() == x.size(1),
                      "block_shape must hold capacity x width (", capacity, " x ", x.size(1), "), got ", block_shape);
    const RouteRows routes = rows_of(idx, index_tensor(slot, "slot"), num_experts, capacity);
    Blocks b = empty_blocks(num_experts, capacity, x.size(1));
    for (int64_t e = 0; e < num_experts; ++e) b.each.push_back(at::empty(block_shape, x.options()));
    scatter_rows(x.contiguous(), routes, idx.size(1), b, nullptr, nullptr);
    return b.each;
}

// A combine gradient [S, M] that fits the routes (S rows) and the expert blocks (width M, their dtype).
void check_grad(const at::Tensor& grad, const at::Tensor& idx, const Blocks& b) {
    TORCH_CHECK_TYPE(grad.scalar_type() == dtype_of(b), "grad must have the blocks' dtype ", dtype_of(b), ", got ",
                     grad.scalar_type());
    TORCH_CHECK_VALUE(grad.size(0) == idx.size(0) && grad.size(1) == b.width, "grad must have shape [", idx.size(0),
                      ", ", b.width, "], got ", grad.sizes());
}

std::optional<at::Tensor> py_scatter_over(const std::vector<std::optional<at::Tensor>>& blocks,
                                          const at::Tensor& grad, const at::Tensor& expert_idx,
                                          const at::Tensor& slot, int64_t num_experts, int64_t capacity,
                                          const at::Tensor& weight, bool need_dots) {
    check_data(grad, "grad", 2);
    const at::Tensor idx = index_tensor(expert_idx, "expert_idx");
    const at::Tensor sl = index_tensor(slot, "slot");
    const at::Tensor w = weight_tensor(weight, idx);
    const Blocks b = blocks_of(blocks, num_experts, capacity, false);
    check_grad(grad, idx, b);
    const RouteRows routes = rows_of(idx, sl, num_experts, capacity);
    at::Tensor dots;
    if (need_dots) dots = at::zeros({idx.size(0), idx.size(1)}, w.options());
    scatter_rows(grad.contiguous(), routes, idx.size(1), b, w.const_data_ptr<float>(),
                 need_dots ? dots.mutable_data_ptr<float>() : nullptr);
    if (!need_dots) return std::nullopt;
    return dots;
}

at::Tensor py_gather(const std::vector<std::optional<at::Tensor>>& blocks, const at::Tensor& expert_idx,
                     const at::Tensor& slot, int64_t num_experts, int64_t capacity,
                     const std::optional<at::Tensor>& weight) {
    const at::Tensor idx = index_tensor(expert_idx, "expert_idx");
    const at::Tensor sl = index_tensor(slot, "slot");
    const at::Tensor w = optional_weight(weight, idx);
    const Blocks b = blocks_of(blocks, num_experts, capacity, true);
    const RouteRows routes = rows_of(idx, sl, num_experts, capacity);
    return gather_rows(b, routes, idx.size(0), idx.size(1), data_or_null(w), dtype_of(b));
}

at::Tensor py_route_dots(const at::Tensor& grad, const std::vector<std::optional<at::Tensor>>& blocks,
                         const at::Tensor& expert_idx, const at::Tensor& slot, int64_t num_experts,
                         int64_t capacity) {
    check_data(grad, "grad", 2);
    const at::Tensor idx = index_tensor(expert_idx, "expert_idx");
    const at::Tensor sl = index_tensor(slot, "slot");
    const Blocks b = blocks_of(blocks, num_experts, capacity, true);
    check_grad(grad, idx, b);
    const RouteRows routes = rows_of(idx, sl, num_experts, capacity);
    return route_dots(grad.contiguous(), b, routes, idx.size(1));
}

std::tuple<at::Tensor, at::Tensor> py_top_k(const at::Tensor& scores, int64_t k) {
    check_cpu(scores, "scores");
    TORCH_CHECK_TYPE(scores.scalar_type() == at::kFloat, "scores must be float32, got ", scores.scalar_type());
    TORCH_CHECK_VALUE(scores.dim() == 2, "scores must be 2-D [S, E], got ", scores.sizes());
    const at::Tensor sc = scores.contiguous();
    at::Tensor value = at::empty({sc.size(0), k}, sc.options());
    at::Tensor index = at::empty({sc.size(0), k}, sc.options().dtype(at::kLong));
    top_k(sc.const_data_ptr<float>(), sc.size(0), sc.size(1), k, index.mutable_data_ptr<int64_t>(),
          value.mutable_data_ptr<float>());
    return {value, index};
}

}  // namespace
}  // namespace dnv::moe

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    using namespace dnv::moe;
    namespace py = pybind11;
    m.doc() = "deepnvme moe: capacity slots, index dispatch and combine of Mixture-of-Experts routes (CPU)";
    m.def("assign_slots", &py_assign_slots, py::arg("expert_idx"), py::arg("num_experts"), py::arg("capacity"),
          py::arg("priority"), py::arg("active"), py::arg("choice_major"),
          "(slot[S,k] int64 with -1 for dropped, exp_counts[E]); capacity -1 keeps every route");
    m.def("top_k", &py_top_k, py::arg("scores"), py::arg("k"),
          "(values, indices) of the k largest scores per row, largest first, ties to the lower index");
    m.def("scatter", &py_scatter, py::arg("x"), py::arg("expert_idx"), py::arg("slot"), py::arg("num_experts"),
          py::arg("capacity"), py::arg("weight") = py::none(),
          "x[S,M] -> new [E,C,M]: each kept route's row gets its token (times its weight); empty rows are zero");
    m.def("scatter_blocks", &py_scatter_blocks, py::arg("x"), py::arg("expert_idx"), py::arg("slot"),
          py::arg("num_experts"), py::arg("capacity"), py::arg("block_shape"),
          "x[S,M] -> E new tensors of block_shape (C*M elements each), one expert's rows each");
    m.def("scatter_over", &py_scatter_over, py::arg("blocks"), py::arg("grad"), py::arg("expert_idx"),
          py::arg("slot"), py::arg("num_experts"), py::arg("capacity"), py::arg("weight"), py::arg("need_dots"),
          "write scatter(grad, weight) over the given blocks; with need_dots first return each route's "
          "grad . old row");
    m.def("gather", &py_gather, py::arg("blocks"), py::arg("expert_idx"), py::arg("slot"), py::arg("num_experts"),
          py::arg("capacity"), py::arg("weight") = py::none(),
          "blocks -> [S,M]: each token's kept rows (times their weights) summed in float32, choice order");
    m.def("route_dots", &py_route_dots, py::arg("grad"), py::arg("blocks"), py::arg("expert_idx"), py::arg("slot"),
          py::arg("num_experts"), py::arg("capacity"),
          "[S,k] float32: grad[s] . row(s,j) for kept routes, 0 for dropped");
}
