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

at::Tensor py_scatter(const at::Tensor& x, const at::Tensor& expert_idx, const at::Tensor& slot, int64_t num_experts,
                      int64_t capacity, const std::optional<at::Tensor>& weight) {
    check_data(x, "x", 2);
    const at::Tensor idx = index_tensor(expert_idx, "expert_idx");
    const at::Tensor sl = index_tensor(slot, "slot");
    TORCH_CHECK_VALUE(num_experts >= 1, "num_experts must be >= 1, got ", num_experts);
    TORCH_CHECK_VALUE(capacity >= 0, "capacity must be >= 0, got ", capacity);
    TORCH_CHECK_VALUE(idx.size(0) == x.size(0), "expert_idx must have ", x.size(0), " rows (one per token), got ",
                      idx.size(0));
    const at::Tensor w = optional_weight(weight, idx);
    const RouteRows routes = rows_of(idx, sl, num_experts, capacity);
    return scatter_rows(x.contiguous(), routes, idx.size(1), num_experts, capacity, data_or_null(w));
}

at::Tensor py_gather(const at::Tensor& y, const at::Tensor& expert_idx, const at::Tensor& slot,
                     const std::optional<at::Tensor>& weight) {
    check_data(y, "y", 3);
    const at::Tensor idx = index_tensor(expert_idx, "expert_idx");
    const at::Tensor sl = index_tensor(slot, "slot");
    const at::Tensor w = optional_weight(weight, idx);
    const RouteRows routes = rows_of(idx, sl, y.size(0), y.size(1));
    return gather_rows(y.contiguous(), routes, idx.size(0), idx.size(1), data_or_null(w));
}

at::Tensor py_route_dots(const at::Tensor& grad, const at::Tensor& y, const at::Tensor& expert_idx,
                         const at::Tensor& slot) {
    check_data(y, "y", 3);
    check_data(grad, "grad", 2);
    TORCH_CHECK_TYPE(grad.scalar_type() == y.scalar_type(), "grad must have y's dtype ", y.scalar_type(), ", got ",
                     grad.scalar_type());
    const at::Tensor idx = index_tensor(expert_idx, "expert_idx");
    const at::Tensor sl = index_tensor(slot, "slot");
    TORCH_CHECK_VALUE(grad.size(0) == idx.size(0) && grad.size(1) == y.size(2), "grad must have shape [",
                      idx.size(0), ", ", y.size(2), "], got ", grad.sizes());
    const RouteRows routes = rows_of(idx, sl, y.size(0), y.size(1));
    return route_dots(grad.contiguous(), y.contiguous(), routes, idx.size(0), idx.size(1));
}

std::optional<at::Tensor> py_scatter_over(at::Tensor y, const at::Tensor& grad, const at::Tensor& expert_idx,
                                         const at::Tensor& slot, const at::Tensor& weight, bool need_dots) {
    check_data(y, "y", 3);
    check_data(grad, "grad", 2);
    TORCH_CHECK_VALUE(y.is_contiguous(), "y must be contiguous (it is overwritten in place)");
    TORCH_CHECK_TYPE(grad.scalar_type() == y.scalar_type(), "grad must have y's dtype ", y.scalar_type(), ", got ",
                     grad.scalar_type());
    const at::Tensor idx = index_tensor(expert_idx, "expert_idx");
    const at::Tensor sl = index_tensor(slot, "slot");
    const at::Tensor w = weight_tensor(weight, idx);
    TORCH_CHECK_VALUE(grad.size(0) == idx.size(0) && grad.size(1) == y.size(2), "grad must have shape [",
                      idx.size(0), ", ", y.size(2), "], got ", grad.sizes());
    const RouteRows routes = rows_of(idx, sl, y.size(0), y.size(1));
    at::Tensor dots;
    if (need_dots) dots = at::zeros({idx.size(0), idx.size(1)}, w.options());
    scatter_rows_over(y, grad.contiguous(), routes, idx.size(1), w.const_data_ptr<float>(),
                      need_dots ? dots.mutable_data_ptr<float>() : nullptr);
    if (!need_dots) return std::nullopt;
    return dots;
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
          "x[S,M] -> [E,C,M]: each kept route's row gets its token (times its weight); empty rows are zero");
    m.def("gather", &py_gather, py::arg("y"), py::arg("expert_idx"), py::arg("slot"), py::arg("weight") = py::none(),
          "y[E,C,M] -> [S,M]: each token's kept rows (times their weights) summed in float32, choice order");
    m.def("route_dots", &py_route_dots, py::arg("grad"), py::arg("y"), py::arg("expert_idx"), py::arg("slot"),
          "[S,k] float32: grad[s] . y[row(s,j)] for kept routes, 0 for dropped");
    m.def("scatter_over", &py_scatter_over, py::arg("y"), py::arg("grad"), py::arg("expert_idx"), py::arg("slot"),
          py::arg("weight"), py::arg("need_dots"),
          "the combine's backward in y's own memory: y becomes scatter(grad, weight); returns route_dots first "
          "(or None)");
}
