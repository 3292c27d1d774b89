// The engine interface: how a worker hands block I/O to the kernel and collects completions.
// One file per engine implements it; the handle never branches on an engine's name.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace dnv {

// One block transfer. `tag` comes back unchanged in the completion.
struct IoOp {
    int fd;
    void* buf;
    size_t len;
    uint64_t off;
    bool write;
    uint64_t tag;
    int fixed_index;  // index of a buffer registered with register_buffers(), or -1
};

// Longest single engine operation. io_uring takes a 32-bit length and the kernel moves at most ~2 GiB per
// read/write call, so a larger block is issued in pieces of this size (a multiple of any device alignment).
constexpr size_t kMaxOpBytes = size_t(1) << 30;

// A finished transfer: res = bytes moved (possibly short) or -errno.
struct IoDone {
    uint64_t tag;
    int64_t res;
};

class Engine {
public:
    virtual ~Engine() = default;
    Engine() = default;
    Engine(const Engine&) = delete;
    Engine& operator=(const Engine&) = delete;

    // Queues up to n ops. Returns how many were accepted; 0 means "busy, retry after a reap".
    // An op the kernel rejects outright is still accepted and completes with -errno.
    // Throws IoError only when the engine itself is broken.
    virtual size_t submit(const IoOp* ops, size_t n) = 0;

    // Blocks until at least min_done completions are ready (min_done <= ops in flight), returns up to max.
    virtual size_t reap(IoDone* out, size_t min_done, size_t max) = 0;

    // Optionally pins buffers in the kernel (io_uring fixed buffers): (address, length) each; an op's
    // fixed_index is its buffer's index here. Returns false if unsupported.
    virtual bool register_buffers(const std::vector<std::pair<void*, size_t>>& /*bufs*/) { return false; }

    // Whether a request may bypass this engine and run as plain pread/pwrite on the caller's thread (the
    // handle's inline path for small sync requests). True for engines that add nothing but scheduling; the
    // fault engine says no, since its faults must reach every request.
    virtual bool allows_bypass() const { return true; }
};

// State shared by all engines of one handle (the fault engine's rule counters); may be null.
struct EngineShared {
    virtual ~EngineShared() = default;
};

// Builds an engine by name ("io_uring", "libaio", "posix", "fault"). Throws UnsupportedError if unavailable.
std::unique_ptr<Engine> make_engine(const std::string& name, unsigned queue_depth,
                                    const std::shared_ptr<EngineShared>& shared);

// Per-handle shared state for an engine, created once by the handle.
std::shared_ptr<EngineShared> make_engine_shared(const std::string& name);

// Engines that pass a real submit-and-complete round trip here, in preference order.
std::vector<std::string> available_engines();

// name -> "ok" or why it is unavailable, for every engine this build knows.
std::vector<std::pair<std::string, std::string>> engine_status();

// Resolves "auto" (or "") through $DEEPNVME_ENGINE and available_engines(); validates explicit names.
std::string resolve_engine(const std::string& requested);

}  // namespace dnv
