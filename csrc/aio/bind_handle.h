// DeepSpeed's handle API as pybind11 methods, written once for every handle binding (aio_handle, gds_handle),
// and the end of every request's way through a binding: collect() and the handle's close.
// H provides: start(tensor, Target, write, validate, Completion, file_offset) -> the request's id (queued, not
// waited for), pipeline(), config(), engine().
#pragma once

#include <Python.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "pipeline.h"
#include "tensor_glue.h"

namespace dnv {

// A request for the host engine from a binding: prepared off the GIL (open() can block on a slow file system),
// its one-time warning raised before any I/O (a warning the filters turn into an error drops the request
// untouched), then queued. Returns its id in io.pipeline().
inline uint64_t enqueue_host(IoHandle& io, const at::Tensor& buffer, const Target& target, bool write,
                             bool validate, Completion completion, int64_t file_offset) {
    IoHandle::Params p = host_params(buffer, target, write, validate, completion, file_offset);
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

// The end of a wait: `wait_for(done)` waits (GIL released) and returns what the call returns; then what asked
// for validation is validated, and the call raises the first failure among `done` as OSError, else a
// validation mismatch, else a read (`own`'s, or any for own == 0) whose tensor was given another storage
// meanwhile. Pipeline::Interrupted becomes the pending KeyboardInterrupt.
template <class WaitFor>
int64_t collect_with(WaitFor&& wait_for, uint64_t own) {
    Handed done;  // released after the GIL is back, also when wait_for throws
    int64_t n = 0;
    bool interrupted = false;
    std::string mismatch;
    with_gil_released([&] {
        try {
            n = wait_for(done);
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
    return n;
}

// Waits for `own` (0 for none) and what the call covers (Pipeline::wait); returns how many requests the call
// covered (see collect_with for what it raises).
inline int64_t collect(Pipeline& pipeline, uint64_t own) {
    return collect_with(
        [&](Handed& done) { return static_cast<int64_t>(pipeline.wait(own, done, signal_pending)); }, own);
}

// Waits for request `id` alone (Pipeline::wait_request); returns its byte count, or raises its own error.
inline int64_t collect_request(Pipeline& pipeline, uint64_t id) {
    return collect_with(
        [&](Handed& done) {
            pipeline.wait_request(id, done, signal_pending);
            return static_cast<int64_t>(done.back()->nbytes);
        },
        id);
}

// Ids of requests of their own that completed since the last call returned them (Pipeline::wait_completed),
// waiting at most `timeout` seconds (None: no limit).
inline std::vector<int64_t> completed_requests(Pipeline& pipeline, const std::optional<double>& timeout) {
    std::chrono::milliseconds limit{-1};
    if (timeout) {
        if (!(*timeout >= 0)) throw ArgError("timeout must be >= 0 seconds or None, got " + std::to_string(*timeout));
        limit = std::chrono::milliseconds(static_cast<int64_t>(std::ceil(std::min(*timeout, 1e9) * 1000)));
    }
    std::vector<uint64_t> ids;
    bool interrupted = false;
    with_gil_released([&] {
        try {
            ids = pipeline.wait_completed(limit, signal_pending);
        } catch (const Pipeline::Interrupted&) {
            interrupted = true;
        }
    });
    if (interrupted) throw py::error_already_set();  // the KeyboardInterrupt (or whatever the handler raised)
    return std::vector<int64_t>(ids.begin(), ids.end());
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

// DeepSpeed's calls: a sync one waits for its request (and the async ones pending) and returns their count; an
// async one returns 0 at once, for wait() to complete.
template <class H>
int64_t run_io(H& h, const at::Tensor& buffer, const Target& target, bool write, bool validate, bool async,
               int64_t file_offset) {
    uint64_t id = h.start(buffer, target, write, validate, async ? Completion::kWait : Completion::kCall, file_offset);
    return async ? 0 : collect(h.pipeline(), id);
}

// A Python request id as the pipeline knows them (ids start at 1).
inline uint64_t request_id(int64_t id) {
    if (id <= 0) throw ArgError("request " + std::to_string(id) + " is not a request id (ids are positive)");
    return static_cast<uint64_t>(id);
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
                  run_io(h, b, by_path(f), write, v, false, off);
                  return 0;
              },
              py::arg("buffer"), py::arg("filename"), py::arg("validate"), py::arg("file_offset") = 0);
        c.def(write ? "pwrite" : "pread",
              [write](H& h, const at::Tensor& b, const std::string& f, bool v, bool a, int64_t off) {
                  return run_io(h, b, by_path(f), write, v, a, off);
              },
              py::arg("buffer"), py::arg("filename"), py::arg("validate"), py::arg("async"), py::arg("file_offset") = 0);
        c.def(write ? "pwrite" : "pread",
              [write](H& h, const at::Tensor& b, int fd, bool v, bool a, int64_t off) {
                  return run_io(h, b, by_fd(fd), write, v, a, off);
              },
              py::arg("buffer"), py::arg("fd"), py::arg("validate"), py::arg("async"), py::arg("file_offset") = 0);
        // bytes that are not UTF-8, str with surrogate escapes, os.PathLike.
        c.def(write ? "write" : "read",
              [write](H& h, const at::Tensor& b, const py::object& f, bool v, int64_t off) {
                  run_io(h, b, by_pathlike(f), write, v, false, off);
                  return 0;
              },
              py::arg("buffer"), py::arg("filename"), py::arg("validate"), py::arg("file_offset") = 0);
        c.def(write ? "pwrite" : "pread",
              [write](H& h, const at::Tensor& b, const py::object& f, bool v, bool a, int64_t off) {
                  return run_io(h, b, by_pathlike(f), write, v, a, off);
              },
              py::arg("buffer"), py::arg("filename"), py::arg("validate"), py::arg("async"), py::arg("file_offset") = 0);
    }
    // sync_/async_ pread/pwrite, each by file name, by descriptor (never closed) and by os.PathLike.
    for (bool write : {false, true}) {
        for (bool async : {false, true}) {
            std::string name = std::string(async ? "async_" : "sync_") + (write ? "pwrite" : "pread");
            c.def(name.c_str(),
                  [write, async](H& h, const at::Tensor& b, const std::string& f, int64_t off) {
                      return run_io(h, b, by_path(f), write, false, async, off);
                  },
                  py::arg("buffer"), py::arg("filename"), py::arg("file_offset") = 0);
            c.def(name.c_str(),
                  [write, async](H& h, const at::Tensor& b, int fd, int64_t off) {
                      return run_io(h, b, by_fd(fd), write, false, async, off);
                  },
                  py::arg("buffer"), py::arg("fd"), py::arg("file_offset") = 0);
            c.def(name.c_str(),
                  [write, async](H& h, const at::Tensor& b, const py::object& f, int64_t off) {
                      return run_io(h, b, by_pathlike(f), write, false, async, off);
                  },
                  py::arg("buffer"), py::arg("filename"), py::arg("file_offset") = 0);
        }
    }
    // Completion per request: submit_pread/submit_pwrite by file name, by descriptor (never closed) and by
    // os.PathLike; each returns the request's id, which wait_request() and request_done() take.
    for (bool write : {false, true}) {
        const char* name = write ? "submit_pwrite" : "submit_pread";
        const char* doc =
            "Queues the transfer and returns its request id at once. Only wait_request(id) completes it: "
            "wait() and the sync calls neither wait for it nor raise its error (README, 'Guarantees').";
        auto submit = [write](H& h, const at::Tensor& b, const Target& t, int64_t off) {
            return static_cast<int64_t>(h.start(b, t, write, false, Completion::kOwn, off));
        };
        c.def(name,
              [submit](H& h, const at::Tensor& b, const std::string& f, int64_t off) {
                  return submit(h, b, by_path(f), off);
              },
              py::arg("buffer"), py::arg("filename"), py::arg("file_offset") = 0, doc);
        c.def(name,
              [submit](H& h, const at::Tensor& b, int fd, int64_t off) { return submit(h, b, by_fd(fd), off); },
              py::arg("buffer"), py::arg("fd"), py::arg("file_offset") = 0, doc);
        c.def(name,
              [submit](H& h, const at::Tensor& b, const py::object& f, int64_t off) {
                  return submit(h, b, by_pathlike(f), off);
              },
              py::arg("buffer"), py::arg("filename"), py::arg("file_offset") = 0, doc);
    }
    c.def("wait_request", [](H& h, int64_t id) { return collect_request(h.pipeline(), request_id(id)); },
          py::arg("request_id"),
          "Waits for that request alone and hands it over: returns its byte count, or raises its error (OSError "
          "with errno and filename). Once per id: ValueError for an id not pending here. Ctrl-C raises "
          "KeyboardInterrupt and leaves the request running, still pending under its id.");
    c.def("request_done",
          [](H& h, int64_t id) {
              bool done = false;
              uint64_t rid = request_id(id);
              with_gil_released([&] { done = h.pipeline().request_done(rid); });
              return done;
          },
          py::arg("request_id"),
          "Whether that request has completed (successfully or not), without waiting or handing it over; "
          "ValueError for an id not pending here.");
    c.def("wait_completed", [](H& h, std::optional<double> timeout) { return completed_requests(h.pipeline(), timeout); },
          py::arg("timeout") = py::none(),
          "Waits until requests made by submit_pread/submit_pwrite have completed that no earlier call returned "
          "(or `timeout` seconds pass: then []), and returns their ids, each to one call only; hands nothing "
          "over (wait_request(id) then returns at once). Also waits while nothing is pending.");
    c.def("wait", [](H& h) { return collect(h.pipeline(), 0); },
          "Waits for every async request pending at the call, whichever thread submitted it; returns how many it "
          "covered and raises the first error among them (README, 'Guarantees'). Requests made by submit_pread/"
          "submit_pwrite are not among them.");
    // DeepSpeed's binding spells the keyword example_tenosr; accept both spellings.
    for (const char* kw : {"example_tensor", "example_tenosr"})
        c.def("new_cpu_locked_tensor", [](H&, int64_t n, const at::Tensor& e) { return new_locked_tensor(n, e); },
              py::arg("num_elem"), py::arg(kw));
    c.def("free_cpu_locked_tensor", [](H&, const at::Tensor& t) { return free_locked_tensor(t); },
          py::arg("tensor"));
}

}  // namespace dnv
