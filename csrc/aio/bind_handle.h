// DeepSpeed's handle API as pybind11 methods, written once for every handle binding (aio_handle, gds_handle),
// and the end of every request's way through a binding: collect() and the handle's close.
// H provides: io(tensor, Target, write, validate, async, file_offset), wait(), config(), engine().
#pragma once

#include <Python.h>

#include <memory>
#include <string>

#include "pipeline.h"
#include "tensor_glue.h"

namespace dnv {

// A request for the host engine from a binding: prepared off the GIL (open() can block on a slow file system),
// its one-time warning raised before any I/O (a warning the filters turn into an error drops the request
// untouched), then queued. Returns its id in io.pipeline().
inline uint64_t enqueue_host(IoHandle& io, const at::Tensor& buffer, const Target& target, bool write,
                             bool validate, bool async, int64_t file_offset) {
    IoHandle::Params p = host_params(buffer, target, write, validate, async, file_offset);
    // Ends the loan (storage_loan.h) with the GIL held should the request fail before it is queued.
    std::shared_ptr<void> hold = p.keepalive;
    std::string warning;
    std::shared_ptr<Request> req;
    with_gil_released([&] { req = io.prepare(std::move(p), warning); });
    if (!warning.empty()) warn(PyExc_RuntimeWarning, warning);
    uint64_t id = 0;
    // A small sync request runs its I/O inside enqueue() (IoHandle::enqueue).
    with_gil_released([&] { id = io.enqueue(std::move(req)); });
    return id;
}

// Ctrl-C: Python's signal handlers run only with the GIL, on the main thread; a long wait polls them.
inline bool signal_pending() {
    py::gil_scoped_acquire gil;
    return PyErr_CheckSignals() != 0;  // leaves the handler's exception (KeyboardInterrupt) set
}

// Waits for `own` (0 for none) and what the call covers (Pipeline::wait), validates what asked for it, and
// raises: the first failure as OSError, else a validation mismatch, else a read whose tensor was given
// another storage meanwhile. Returns how many requests the call covered.
inline int64_t collect(Pipeline& pipeline, uint64_t own) {
    Handed done;  // released after the GIL is back
    size_t n = 0;
    bool interrupted = false;
    std::string mismatch;
    with_gil_released([&] {
        try {
            n = pipeline.wait(own, done, signal_pending);
        } catch (const Pipeline::Interrupted&) {
            interrupted = true;
        }
        for (auto& r : done) {
            if (interrupted || !r->validate || r->failed() || !mismatch.empty()) continue;
            try {
                mismatch = r->verify();
            } catch (const std::exception& e) {
                mismatch = std::string("validation could not read the file back: ") + e.what();
            }
        }
    });
    if (interrupted) {
        done.clear();
        throw py::error_already_set();  // the KeyboardInterrupt (or whatever the handler raised)
    }
    const PendingRequest* bad = first_failure(done);
    int err = bad ? bad->error() : 0;
    std::string what = bad ? bad->error_text() : std::string();
    std::string path = bad ? bad->file.path() : std::string();
    std::string replaced;  // a sync call reports only its own request's
    for (const auto& r : done)
        if (replaced.empty() && (own == 0 || r->id == own)) replaced = replaced_buffer_error(*r);
    done.clear();  // drops the tensor references, with the GIL held
    if (bad) throw IoError(err, what, path);
    if (!mismatch.empty()) raise_runtime(mismatch);
    if (!replaced.empty()) raise_runtime(replaced);
    return static_cast<int64_t>(n);
}

// A binding's destructor: requests still in flight finish first, then `core` (its threads) goes; the
// requests' tensors are released afterwards, with the GIL held.
template <class Core>
void close_core(std::unique_ptr<Core>& core) {
    std::vector<std::shared_ptr<void>> holds;  // an inherited handle's tensor holds, dropped last (GIL held)
    if (core->pipeline().inherited()) core->pipeline().abandon(&holds);
    Handed rest;
    without_gil_unless_finalizing([&] {
        core->pipeline().drain(rest);
        core.reset();
    });
}

template <class H>
void bind_handle_api(py::class_<H>& c) {
    c.def(py::init<int64_t, int64_t, bool, bool, int64_t, const std::string&>(),
          py::arg("block_size") = kDeepSpeedBlockSize, py::arg("queue_depth") = kDeepSpeedQueueDepth,
          py::arg("single_submit") = kDeepSpeedSingleSubmit, py::arg("overlap_events") = kDeepSpeedOverlapEvents,
          py::arg("intra_op_parallelism") = kDeepSpeedParallelism, py::arg("engine") = "auto");
    c.def("get_block_size", [](const H& h) { return static_cast<int64_t>(h.config().block_size); });
    c.def("get_queue_depth", [](const H& h) { return static_cast<int64_t>(h.config().queue_depth); });
    c.def("get_single_submit", [](const H& h) { return h.config().single_submit; });
    c.def("get_overlap_events", [](const H& h) { return h.config().overlap_events; });
    c.def("get_intra_op_parallelism", [](const H& h) { return static_cast<int64_t>(h.config().parallelism); });
    // DeepSpeed's value, which its callers size buffers by (FastFileWriter asserts multiples of it). Any size
    // and offset works here; multiples of the device's block size (4096 on 4Kn drives) skip buffered edges.
    c.def("get_alignment", [](const H& h) { return static_cast<int64_t>(h.config().parallelism * 512); },
          "DeepSpeed's O_DIRECT alignment, 512 x intra_op_parallelism. Any size works; multiples of the device's "
          "block size go entirely O_DIRECT.");
    c.def("get_engine", [](const H& h) { return h.engine(); }, "The engine serving host memory.");

    // DeepSpeed's read/write return 0 on success rather than a count.
    for (bool write : {false, true}) {
        c.def(write ? "write" : "read",
              [write](H& h, const at::Tensor& b, const std::string& f, bool v, int64_t off) {
                  h.io(b, by_path(f), write, v, false, off);
                  return 0;
              },
              py::arg("buffer"), py::arg("filename"), py::arg("validate"), py::arg("file_offset") = 0);
        c.def(write ? "pwrite" : "pread",
              [write](H& h, const at::Tensor& b, const std::string& f, bool v, bool a, int64_t off) {
                  return h.io(b, by_path(f), write, v, a, off);
              },
              py::arg("buffer"), py::arg("filename"), py::arg("validate"), py::arg("async"), py::arg("file_offset") = 0);
        c.def(write ? "pwrite" : "pread",
              [write](H& h, const at::Tensor& b, int fd, bool v, bool a, int64_t off) {
                  return h.io(b, by_fd(fd), write, v, a, off);
              },
              py::arg("buffer"), py::arg("fd"), py::arg("validate"), py::arg("async"), py::arg("file_offset") = 0);
        // bytes that are not UTF-8, str with surrogate escapes, os.PathLike.
        c.def(write ? "write" : "read",
              [write](H& h, const at::Tensor& b, const py::object& f, bool v, int64_t off) {
                  h.io(b, by_pathlike(f), write, v, false, off);
                  return 0;
              },
              py::arg("buffer"), py::arg("filename"), py::arg("validate"), py::arg("file_offset") = 0);
        c.def(write ? "pwrite" : "pread",
              [write](H& h, const at::Tensor& b, const py::object& f, bool v, bool a, int64_t off) {
                  return h.io(b, by_pathlike(f), write, v, a, off);
              },
              py::arg("buffer"), py::arg("filename"), py::arg("validate"), py::arg("async"), py::arg("file_offset") = 0);
    }
    // sync_/async_ pread/pwrite, each by file name, by descriptor (never closed) and by os.PathLike.
    for (bool write : {false, true}) {
        for (bool async : {false, true}) {
            std::string name = std::string(async ? "async_" : "sync_") + (write ? "pwrite" : "pread");
            c.def(name.c_str(),
                  [write, async](H& h, const at::Tensor& b, const std::string& f, int64_t off) {
                      return h.io(b, by_path(f), write, false, async, off);
                  },
                  py::arg("buffer"), py::arg("filename"), py::arg("file_offset") = 0);
            c.def(name.c_str(),
                  [write, async](H& h, const at::Tensor& b, int fd, int64_t off) {
                      return h.io(b, by_fd(fd), write, false, async, off);
                  },
                  py::arg("buffer"), py::arg("fd"), py::arg("file_offset") = 0);
            c.def(name.c_str(),
                  [write, async](H& h, const at::Tensor& b, const py::object& f, int64_t off) {
                      return h.io(b, by_pathlike(f), write, false, async, off);
                  },
                  py::arg("buffer"), py::arg("filename"), py::arg("file_offset") = 0);
        }
    }
    c.def("wait", &H::wait,
          "Waits for every async request pending at the call, whichever thread submitted it; returns how many it "
          "covered and raises the first error among them (README, 'Guarantees').");
    // DeepSpeed's binding spells the keyword example_tenosr; accept both spellings.
    for (const char* kw : {"example_tensor", "example_tenosr"})
        c.def("new_cpu_locked_tensor", [](H&, int64_t n, const at::Tensor& e) { return new_locked_tensor(n, e); },
              py::arg("num_elem"), py::arg(kw));
    c.def("free_cpu_locked_tensor", [](H&, const at::Tensor& t) { return free_locked_tensor(t); },
          py::arg("tensor"));
}

}  // namespace dnv
