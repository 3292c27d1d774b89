// Python binding of the pin_memory op: DeepSpeed's pin_handle over the process-wide locked-memory registry
// that every aio and gds handle shares.
#include <cstdint>

#include "tensor_glue.h"

namespace dnv {
namespace {

// No state of its own: the registry is process-wide, which is what lets handles recognise each other's buffers.
class PinHandle {};

}  // namespace
}  // namespace dnv

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    using namespace dnv;
    namespace py = pybind11;
    attach_shared_registry();
    register_translators();
    m.doc() = "deepnvme pin_memory: page-aligned locked CPU tensors shared with every aio/gds handle";
    py::class_<PinHandle>(m, "pin_handle")
        .def(py::init<>())
        .def("new_cpu_locked_tensor", [](PinHandle&, int64_t n, const at::Tensor& e) { return new_locked_tensor(n, e); },
             py::arg("num_elem"), py::arg("example_tensor"))
        .def("free_cpu_locked_tensor", [](PinHandle&, const at::Tensor& t) { return free_locked_tensor(t); },
             py::arg("locked_tensor"))
        .def("free_cpu_locked_tensor_by_ptr",
             [](PinHandle&, uintptr_t addr) { return shared_registry().forget(reinterpret_cast<void*>(addr)); },
             py::arg("address"))
        .def("is_pinned", [](PinHandle&, const at::Tensor& t) { return is_pinned_tensor(t); }, py::arg("buffer"))
        .def("locked_bytes", [](PinHandle&) { return shared_registry().registered_bytes(); },
             "Bytes currently registered as locked in this process (for leak checks).");
}
