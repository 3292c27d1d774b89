// Python binding of the async_io op: DeepSpeed's aio_handle API over dnv::IoHandle. Thin on purpose: it
// checks arguments, turns tensors into spans, releases the GIL around anything that blocks, and raises.
#include <Python.h>

#include <memory>
#include <string>
#include <vector>

#include "aligned_tensor.h"
#include "engine.h"
#include "handle.h"
#include "staging.h"
#include "bind_handle.h"
#include "tensor_glue.h"

namespace dnv {
namespace {

class AioHandle {
public:
    AioHandle(int64_t block_size, int64_t queue_depth, bool single_submit, bool overlap_events,
              int64_t parallelism, const std::string& engine) {
        HandleConfig cfg = make_config(block_size, queue_depth, single_submit, overlap_events, parallelism, engine);
        with_gil_released([&] { core_ = std::make_unique<IoHandle>(cfg); });
    }

    ~AioHandle() { close_core(core_); }

    // Queues a transfer and returns its id in pipeline(); bind_handle.h waits for it as `completion` says.
    uint64_t start(const at::Tensor& buffer, const Target& target, bool write, bool validate, Completion completion,
                   int64_t file_offset) {
        if (file_offset < 0) throw ArgError("file_offset must be >= 0, got " + std::to_string(file_offset));
        if (target.fd < -1) throw ArgError("fd must be a non-negative file descriptor");
        return enqueue_host(*core_, buffer, target, write, validate, completion, file_offset);
    }

    Pipeline& pipeline() { return core_->pipeline(); }

    const HandleConfig& config() const { return core_->config(); }
    const std::string& engine() const { return core_->engine_name(); }

private:
    std::unique_ptr<IoHandle> core_;
};

int64_t whole_file_op(const at::Tensor& buffer, const py::object& filename, int64_t block_size,
                      int64_t queue_depth, bool single_submit, bool overlap_events, bool validate, bool write) {
    AioHandle h(block_size, queue_depth, single_submit, overlap_events, 1, "auto");
    run_io(h, buffer, by_pathlike(filename), write, validate, false, 0);
    return 0;
}

}  // namespace
}  // namespace dnv

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    using namespace dnv;
    namespace py = pybind11;
    attach_shared_registry();
    register_translators();
    m.doc() = "deepnvme async_io: DeepSpeed-compatible aio_handle over io_uring, libaio or POSIX threads";

    m.def("aio_read",
          [](const at::Tensor& b, const py::object& f, int64_t bs, int64_t qd, bool ss, bool oe, bool v) {
              return whole_file_op(b, f, bs, qd, ss, oe, v, false);
          },
          "Read buffer.nbytes from the start of a file (DeepSpeed's aio_read); returns 0.");
    m.def("aio_write",
          [](const at::Tensor& b, const py::object& f, int64_t bs, int64_t qd, bool ss, bool oe, bool v) {
              return whole_file_op(b, f, bs, qd, ss, oe, v, true);
          },
          "Write a buffer at the start of a file (DeepSpeed's aio_write); returns 0.");
    m.def("deepspeed_memcpy",
          [](at::Tensor& dest, const at::Tensor& src) {
              dest.copy_(src);
              return 0;
          },
          py::arg("dest"), py::arg("src"));
    m.def("empty_at_residue", &empty_at_residue, py::arg("nbytes"), py::arg("residue"),
          "A uint8 CPU tensor whose memory starts `residue` bytes past a page boundary (deepnvme.load).");
    m.def("empty_fresh", &empty_fresh, py::arg("nbytes"), py::arg("residue"),
          "empty_at_residue's tensor over memory whose whole pages a read fills without the kernel zeroing them "
          "first (userfaultfd; plain memory where fresh_memory_status() is not 'ok'). Call settle_fresh() on it "
          "once its reads are done.");
    m.def("settle_fresh", [](const at::Tensor& t) {
              if (FreshBlock* b = fresh_block_of(t)) fresh_settle(*b);
          }, py::arg("tensor"),
          "Makes an empty_fresh tensor's memory plain memory (pages not filled read as zero); nothing for others.");
    m.def("fresh_memory_status", &fresh_memory_status,
          "'ok' when empty_fresh's memory is filled without zeroing here, else why not.");
    m.def("staging_pool_stats", [] {
        StagingArena::Stats s = StagingArena::shared().stats();
        py::dict d;
        d["buffers"] = s.buffers;
        d["free"] = s.free;
        d["buffer_bytes"] = s.buffer_bytes;
        d["allocated"] = s.allocated;
        return d;
    }, "The process-wide staging pool's bookkeeping (read-only): buffers, free, buffer_bytes, allocated. Every "
       "buffer is free whenever no staged transfer is in flight.");
    m.def("available_engines", &available_engines, "Engines usable here, in the order 'auto' tries them.");
    m.def("engine_status", [] {
        py::dict d;
        for (const auto& [name, why] : engine_status()) d[py::str(name)] = why;
        return d;
    }, "Every engine this build knows: 'ok' or why it is unavailable.");

    py::class_<AioHandle> handle(m, "aio_handle");
    bind_handle_api(handle);
    handle
        .def("is_pinned", [](AioHandle&, const at::Tensor& t) { return is_pinned_tensor(t); }, py::arg("buffer"));
}
