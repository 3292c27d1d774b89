// What both bindings (async_io and pin_memory) need from torch: turning tensors into raw spans or copiers,
// locked tensors, and the exception translation. Included only by binding files: it pulls in torch headers.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <torch/csrc/utils/pybind.h>

#include <cxxabi.h>
#include <unistd.h>

#include <memory>
#include <string>

#include "aligned_tensor.h"
#include "error.h"
#include "handle.h"
#include "pinned.h"
#include "storage_loan.h"

namespace dnv {

namespace py = pybind11;

// Python text for a message that may hold file names in any bytes: invalid UTF-8 shows as \xNN escapes
// instead of failing the conversion (and losing the exception it was meant for).
inline py::str message_text(const std::string& s) {
    PyObject* o = PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "backslashreplace");
    if (o == nullptr) throw py::error_already_set();
    return py::reinterpret_steal<py::str>(o);
}

// Raises a Python warning from C++; a warning turned into an error by the filters propagates.
inline void warn(PyObject* category, const std::string& text) {
    py::module_::import("warnings").attr("warn")(message_text(text), py::handle(category), 1);
}

// Raises RuntimeError(text) from C++ (validation mismatches, replaced buffers).
[[noreturn]] inline void raise_runtime(const std::string& text) {
    PyErr_SetObject(PyExc_RuntimeError, message_text(text).ptr());
    throw py::error_already_set();
}

// Copies through torch for memory the engine cannot address (CUDA and other device tensors).
class TensorCopier final : public Copier {
public:
    explicit TensorCopier(const at::Tensor& t) : bytes_(t.reshape({-1}).view(at::kByte)) {}
    void to_host(void* dst, size_t offset, size_t len) const override {
        host(dst, len).copy_(bytes_.narrow(0, static_cast<int64_t>(offset), static_cast<int64_t>(len)));
    }
    void from_host(size_t offset, const void* src, size_t len) const override {
        bytes_.narrow(0, static_cast<int64_t>(offset), static_cast<int64_t>(len))
            .copy_(host(const_cast<void*>(src), len));
    }

private:
    static at::Tensor host(void* p, size_t len) {
        return at::from_blob(p, {static_cast<int64_t>(len)}, at::TensorOptions().dtype(at::kByte));
    }
    at::Tensor bytes_;
};

// What a pending request holds of its tensor: the tensor, and a loan of its storage and memory
// (storage_loan.h), so that neither `del`, `tensor.set_()`, `tensor.data = ...`, a resize nor
// `share_memory_()` can free the memory under the request.
struct TensorHold {
    at::Tensor tensor;
    c10::Storage storage;
    const void* data = nullptr;
    StorageLoan loan;

    explicit TensorHold(const at::Tensor& t)
        : tensor(t), storage(t.storage()), data(t.data_ptr()), loan(storage) {}

    // True when the tensor no longer shows the memory the request used (its storage or memory was replaced).
    bool replaced() const {
        return !tensor.has_storage() || tensor.storage().unsafeGetStorageImpl() != storage.unsafeGetStorageImpl() ||
               tensor.data_ptr() != data;
    }
};

// The tensor a request really moves: conjugate and negative views hold raw bits that differ from the values
// they show. A write takes their values (a resolved copy); a read into one is refused, since the file's bytes
// would land as raw bits and read back as other values.
inline at::Tensor resolved_for_io(const at::Tensor& t, bool write, const char* name = "buffer") {
    if (!t.defined() || (!t.is_conj() && !t.is_neg())) return t;
    if (!write)
        throw ArgError(std::string(name) + " is a " + (t.is_conj() ? "conjugate" : "negative") +
                       " view: a read would store the file's bytes as its raw bits; read into a plain tensor and "
                       "take .conj() / negate it afterwards");
    return t.resolve_conj().resolve_neg();
}

// The memory of a tensor argument as the engine wants it. Raises ValueError naming the argument.
struct BufferArg {
    char* mem = nullptr;
    size_t nbytes = 0;
    std::shared_ptr<const Copier> copier;
    std::shared_ptr<void> keepalive;  // a TensorHold
};

inline BufferArg buffer_arg(const at::Tensor& t, const char* name = "buffer") {
    if (!t.defined()) throw ArgError(std::string(name) + " is an undefined tensor");
    if (t.layout() != at::kStrided) throw ArgError(std::string(name) + " must be a dense (strided) tensor");
    if (!t.is_contiguous())
        throw ArgError(std::string(name) + " must be contiguous (call .contiguous() first; a copy would make "
                       "reads land in a temporary)");
    if (t.device().is_meta()) throw ArgError(std::string(name) + " is a meta tensor: it has no memory");
    BufferArg b;
    b.nbytes = t.nbytes();
    if (t.device().is_cpu()) {
        b.mem = static_cast<char*>(t.data_ptr());
    } else if (b.nbytes > 0) {
        b.copier = std::make_shared<TensorCopier>(t);
    }
    b.keepalive = std::make_shared<TensorHold>(t);
    return b;
}

// For a read handed over by wait(): an error text when the caller swapped the tensor's storage while the
// read was pending (the bytes went to the old storage, which was kept alive for them), else "".
inline std::string replaced_buffer_error(const PendingRequest& r) {
    if (r.write || !r.keepalive) return {};
    if (!static_cast<const TensorHold*>(r.keepalive.get())->replaced()) return {};
    return "the buffer of the read from " + r.file.path() +
           " was given other memory while the read was pending (tensor.set_(), .data = or .share_memory_()): "
           "the bytes went to the memory it had before, not to the tensor";
}

// Where a request goes: a path or a caller's descriptor (never closed by us).
struct Target {
    std::string path;
    int fd = -1;
};

inline Target by_path(const std::string& p) {
    if (p.find('\0') != std::string::npos) throw ArgError("filename contains a NUL byte");
    return Target{p, -1};
}
inline Target by_fd(int fd) {
    if (fd < 0) throw ArgError("fd must be a non-negative file descriptor, got " + std::to_string(fd));
    return Target{{}, fd};
}
// str (any, including surrogate-escaped non-UTF-8 names), bytes or os.PathLike, encoded as os.fsencode does.
inline Target by_pathlike(const py::object& o) {
    py::object b = py::module_::import("os").attr("fsencode")(o);
    return by_path(b.cast<std::string>());
}

inline bool is_pinned_tensor(const at::Tensor& t) {
    if (!t.defined() || !t.device().is_cpu() || t.layout() != at::kStrided) return false;
    try {
        if (t.is_pinned()) return true;
    } catch (const std::exception&) {
        // CPU-only builds may refuse the question; the registry below still answers it.
    }
    return t.nbytes() > 0 && shared_registry().contains(t.data_ptr(), t.nbytes());
}

// Runs fn with the GIL released, taken back by a plain call rather than in a destructor (py::gil_scoped_release
// takes it back in one): CPython ends a thread that takes the GIL back while the interpreter finalizes with
// an unwind (pthread_exit), which a destructor cannot let through (std::terminate: the process aborts).
// So a daemon thread inside wait() at exit just ends.
template <class F>
void with_gil_released(F&& fn) {
    PyThreadState* ts = PyEval_SaveThread();
    try {
        fn();
    } catch (abi::__forced_unwind&) {
        throw;  // this thread is being ended: it must not touch the interpreter again
    } catch (...) {
        PyEval_RestoreThread(ts);
        throw;
    }
    PyEval_RestoreThread(ts);
}

// A 1-D CPU tensor over page-aligned memory registered as locked. Its memory is freed when the tensor dies,
// so free_cpu_locked_tensor() can never leave a dangling tensor behind.
inline at::Tensor new_locked_tensor(int64_t num_elem, const at::Tensor& example) {
    if (num_elem <= 0) throw ArgError("num_elem must be positive, got " + std::to_string(num_elem));
    auto dtype = example.scalar_type();
    size_t elem = c10::elementSize(dtype);
    // Beyond this no machine has the memory, and the byte count itself would overflow.
    if (static_cast<uint64_t>(num_elem) > (uint64_t{1} << 60) / elem)
        throw std::bad_alloc();
    size_t bytes = static_cast<size_t>(num_elem) * elem;
    PinnedRegistry* reg = &shared_registry();
    PinnedRegistry::Allocation a{};
    with_gil_released([&] { a = reg->allocate(bytes); });  // locking gigabytes takes a while
    at::Tensor t = at::from_blob(
        a.ptr, {num_elem}, [reg](void* p) { reg->release(p); },
        at::TensorOptions().dtype(dtype).device(at::kCPU));
    if (!a.locked)
        warn(PyExc_RuntimeWarning, "mlock of " + std::to_string(bytes) + " bytes was refused (" +
                                       errno_text(a.lock_errno) +
                                       "; see RLIMIT_MEMLOCK / ulimit -l): the tensor works but is not locked");
    return t;
}

inline bool free_locked_tensor(const at::Tensor& t) {
    return t.defined() && t.device().is_cpu() && t.layout() == at::kStrided && shared_registry().forget(t.data_ptr());
}

// The host-side request for `buffer` (a CPU tensor, or a device tensor through its copier) at `target`.
inline IoHandle::Params host_params(const at::Tensor& buffer, const Target& target, bool write, bool validate,
                                    Completion completion, int64_t file_offset) {
    const at::Tensor resolved = resolved_for_io(buffer, write);
    BufferArg b = buffer_arg(resolved);
    IoHandle::Params p;
    p.write = write;
    p.mem = b.mem;
    p.copier = std::move(b.copier);
    // Memory still armed for filling (aligned_tensor.h): staged, and filled without being zeroed first.
    FreshBlock* fresh = b.mem != nullptr && b.nbytes > 0 ? fresh_block_of(resolved) : nullptr;
    if (fresh != nullptr && fresh->armed.load(std::memory_order_acquire))
        p.copier = std::make_shared<FreshCopier>(fresh, b.mem);
    p.nbytes = b.nbytes;
    p.offset = static_cast<uint64_t>(file_offset);
    p.path = target.path;
    p.fd = target.fd;
    p.completion = completion;
    p.validate = validate;
    p.keepalive = std::move(b.keepalive);
    return p;
}


// Runs fn with the GIL released, except while the interpreter shuts down (there is no GIL state to give up
// then). For handle destructors, which wait for requests still in flight.
inline bool interpreter_finalizing() {
    // Only CPython's public API: 3.13 made Py_IsFinalizing public and removed the private _Py_IsFinalizing,
    // which is the only spelling before it.
#if PY_VERSION_HEX >= 0x030D0000
    return Py_IsFinalizing();
#else
    return _Py_IsFinalizing();
#endif
}

// Inside a destructor, where CPython's ending of a thread that retakes the GIL during finalization cannot
// unwind (with_gil_released): a thread that finds the interpreter finalizing once fn is done is a daemon
// thread the process is about to end, so it waits for that end instead of retaking the GIL.
template <class F>
void without_gil_unless_finalizing(F&& fn) {
    if (!Py_IsInitialized() || interpreter_finalizing()) {
        fn();
        return;
    }
    PyThreadState* ts = PyEval_SaveThread();
    try {
        fn();
    } catch (...) {
        PyEval_RestoreThread(ts);
        throw;
    }
    if (interpreter_finalizing())
        for (;;) ::pause();
    PyEval_RestoreThread(ts);
}

// OSError(errno, message, filename) so that Python picks FileNotFoundError, PermissionError...
inline void register_translators() {
    static bool done = false;
    if (done) return;
    done = true;
    py::register_local_exception_translator([](std::exception_ptr p) {
        try {
            if (p) std::rethrow_exception(p);
        } catch (const IoError& e) {
            // The file name as Python spells it: os.fsdecode of its bytes, so non-UTF-8 names survive.
            py::object filename = py::none();
            if (!e.path().empty()) {
                PyObject* f = PyUnicode_DecodeFSDefaultAndSize(e.path().data(), static_cast<Py_ssize_t>(e.path().size()));
                if (f == nullptr) throw py::error_already_set();
                filename = py::reinterpret_steal<py::object>(f);
            }
            PyObject* exc = PyObject_CallFunction(PyExc_OSError, "iOO", e.err(), message_text(e.what()).ptr(),
                                                  filename.ptr());
            if (exc != nullptr) {
                PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc)), exc);
                Py_DECREF(exc);
            }
        } catch (const ArgError& e) {
            PyErr_SetObject(PyExc_ValueError, message_text(e.what()).ptr());
        } catch (const UnsupportedError& e) {
            PyErr_SetObject(PyExc_RuntimeError, message_text(e.what()).ptr());
        }
    });
}

}  // namespace dnv
