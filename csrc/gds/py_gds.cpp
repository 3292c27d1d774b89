// Python binding of the gds op: aio_handle's API plus device-buffer pinning, over dnv::gds::GdsHandle.
// CUDA tensors go through cuFile; every other tensor through the host engine, exactly as in aio_handle.
#include <Python.h>

#include <ATen/ops/empty.h>

#include <memory>
#include <string>
#include <vector>

#include "device_buffers.h"
#include "gds_handle.h"
#include "bind_handle.h"
#include "tensor_glue.h"

namespace dnv::gds {
namespace {

at::Tensor require_cuda(const at::Tensor& t, const char* name) {
    if (!t.defined() || !t.is_cuda()) throw ArgError(std::string(name) + " must be a CUDA tensor");
    if (!t.is_contiguous()) throw ArgError(std::string(name) + " must be contiguous");
    return t;
}

// torch's current stream on `device`, as the raw handle torch exposes to Python.
cudaStream_t current_stream(int device) {
    py::object s = py::module_::import("torch").attr("cuda").attr("current_stream")(device);
    return reinterpret_cast<cudaStream_t>(s.attr("cuda_stream").cast<uintptr_t>());
}

class PyGdsHandle {
public:
    PyGdsHandle(int64_t block_size, int64_t queue_depth, bool single_submit, bool overlap_events,
                int64_t parallelism, const std::string& engine) {
        HandleConfig cfg = make_config(block_size, queue_depth, single_submit, overlap_events, parallelism, engine);
        py::gil_scoped_release nogil;  // opening the cuFile driver takes a while
        core_ = std::make_unique<GdsHandle>(cfg);
    }

    ~PyGdsHandle() { close_core(core_); }

    // Queues a transfer and returns its id in pipeline(); bind_handle.h waits for it as `completion` says.
    uint64_t start(const at::Tensor& given, const Target& target, bool write, bool validate, Completion completion,
                   int64_t file_offset) {
        if (file_offset < 0) throw ArgError("file_offset must be >= 0, got " + std::to_string(file_offset));
        std::string warning;
        uint64_t id = 0;
        at::Tensor buffer = resolved_for_io(given, write);  // conjugate/negative views: values, or refused
        if (buffer.defined() && buffer.is_cuda()) {
            if (!buffer.is_contiguous())
                throw ArgError("buffer must be contiguous (call .contiguous() first; a copy would make reads land "
                               "in a temporary)");
            GdsHandle::DeviceParams p;
            p.write = write;
            p.device = buffer.get_device();
            p.ptr = static_cast<char*>(buffer.data_ptr());
            p.nbytes = buffer.nbytes();
            p.offset = static_cast<uint64_t>(file_offset);
            p.path = target.path;
            p.fd = target.fd;
            p.completion = completion;
            p.validate = validate;
            p.keepalive = std::make_shared<TensorHold>(buffer);  // as for host tensors: held and frozen
            cudaStream_t stream = current_stream(p.device);
            py::gil_scoped_release nogil;
            {
                // cuFile is not ordered with CUDA streams: the kernels that produce (write) or still read
                // (read) this buffer on torch's current stream must be done before cuFile touches it.
                DeviceGuard guard(p.device);
                check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize before cuFile I/O");
            }
            id = core_->submit_device(std::move(p), warning);
        } else {
            id = enqueue_host(core_->host(), buffer, target, write, validate, completion, file_offset);
        }
        if (!warning.empty()) warn(PyExc_RuntimeWarning, warning);
        return id;
    }

    Pipeline& pipeline() { return core_->pipeline(); }

    bool pin(const at::Tensor& t) {
        require_cuda(t, "tensor");
        int dev = t.get_device();
        void* ptr = t.data_ptr();
        size_t n = t.nbytes();
        auto keep = std::make_shared<at::Tensor>(t);  // the memory must outlive its registration
        py::gil_scoped_release nogil;
        DeviceBuffers::instance().pin(dev, ptr, n, std::move(keep));
        return true;
    }

    bool unpin(const at::Tensor& t) {
        require_cuda(t, "tensor");
        const void* ptr = t.data_ptr();
        bool found;
        {
            py::gil_scoped_release nogil;
            found = DeviceBuffers::instance().unpin(ptr);
        }
        return found;
    }

    // A CUDA tensor registered with cuFile for its whole life: its deleter deregisters before the memory
    // goes back to torch, so the registration can never outlive the memory.
    at::Tensor new_pinned(int64_t num_elem, const at::Tensor& example) {
        if (num_elem <= 0) throw ArgError("num_elem must be positive, got " + std::to_string(num_elem));
        at::TensorOptions opts = at::TensorOptions().dtype(example.scalar_type());
        int dev = example.is_cuda() ? example.get_device()
                                    : py::module_::import("torch").attr("cuda").attr("current_device")().cast<int>();
        at::Tensor mem = at::empty({num_elem}, opts.device(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(dev))));
        void* ptr = mem.data_ptr();
        size_t n = mem.nbytes();
        uint64_t token;
        {
            py::gil_scoped_release nogil;
            token = DeviceBuffers::instance().pin(dev, ptr, n, nullptr);
        }
        return at::from_blob(
            ptr, {num_elem},
            [mem, token](void*) mutable {
                DeviceBuffers::instance().unpin_token(token);
                mem.reset();
            },
            mem.options());
    }

    const GdsHandle& core() const { return *core_; }
    const HandleConfig& config() const { return core_->config(); }
    const std::string& engine() const { return core_->engine_name(); }

private:
    std::unique_ptr<GdsHandle> core_;
};

py::dict driver_info(const DriverInfo& d, uint64_t staged) {
    py::dict out;
    out["mode"] = d.mode();
    out["gpudirect"] = d.gpudirect;
    out["compat_allowed"] = d.compat_allowed;
    out["compat_forced"] = d.compat_forced;
    out["nvfs_version"] = std::to_string(d.nvfs_major) + "." + std::to_string(d.nvfs_minor);
    out["status_flags"] = d.status_flags;
    out["control_flags"] = d.control_flags;
    out["feature_flags"] = d.feature_flags;
    out["max_direct_io_size_kb"] = d.max_direct_io_size_kb;
    out["cufile_version"] = d.version;
    out["user_config"] = d.user_config;
    out["log_dir"] = d.log_dir;
    out["notes"] = d.notes;
    out["staged_requests"] = staged;
    return out;
}

}  // namespace
}  // namespace dnv::gds

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    using namespace dnv;
    using namespace dnv::gds;
    namespace py = pybind11;
    attach_shared_registry();
    register_translators();
    m.doc() = "deepnvme gds: DeepSpeed-compatible gds_handle; CUDA tensors through cuFile (GPUDirect Storage)";

    py::class_<PyGdsHandle> handle(m, "gds_handle");
    bind_handle_api(handle);
    handle
        .def("get_io_mode", [](const PyGdsHandle& h) { return std::string(h.core().driver().mode()); },
             "'gpudirect' when cuFile moves data by DMA between GPU and storage, 'compat' when it goes through "
             "host memory (cuFile's compatibility mode).")
        .def("is_gpudirect", [](const PyGdsHandle& h) { return h.core().driver().gpudirect; })
        .def("get_io_info", [](const PyGdsHandle& h) { return driver_info(h.core().driver(), h.core().staged_requests()); },
             "cuFile's session as it describes itself, and how many CUDA requests were staged through host memory.")
        .def("is_pinned",
             [](PyGdsHandle&, const at::Tensor& t) {
                 if (t.defined() && t.is_cuda())
                     return t.nbytes() > 0 && DeviceBuffers::instance().contains(t.data_ptr(), t.nbytes());
                 return is_pinned_tensor(t);
             },
             py::arg("buffer"))
        .def("new_pinned_device_tensor", &PyGdsHandle::new_pinned, py::arg("num_elem"), py::arg("example_tensor"))
        .def("new_pinned_device_tensor", &PyGdsHandle::new_pinned, py::arg("num_elem"), py::arg("example_tenosr"))
        .def("free_pinned_device_tensor", &PyGdsHandle::unpin, py::arg("tensor"),
             "Deregisters from cuFile; the memory goes back to torch when the tensor dies. False if not pinned.")
        .def("pin_device_tensor", &PyGdsHandle::pin, py::arg("tensor"),
             "Registers a CUDA tensor with cuFile (holding its memory until unpin_device_tensor).")
        .def("unpin_device_tensor", &PyGdsHandle::unpin, py::arg("tensor"),
             "Deregisters a tensor pinned with pin_device_tensor; False if it was not pinned.");
}
