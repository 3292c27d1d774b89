// One tensor transfer through the engine, as the handle, its workers, the synchronous transfers and the
// verification all see it: where its memory is, how it was planned, and its per-thread slices.
// Plain C++ (no torch): the binding hands it raw memory, or a Copier for memory it cannot touch directly.
#pragma once

#include <atomic>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "pipeline.h"
#include "plan.h"

namespace dnv {

// Moves bytes between host staging memory and memory the engine cannot address (e.g. a CUDA tensor).
// Offsets are relative to the start of the request's memory. Called on worker threads.
class Copier {
public:
    virtual ~Copier() = default;
    virtual void to_host(void* dst, size_t offset, size_t len) const = 0;      // for writes
    virtual void from_host(size_t offset, const void* src, size_t len) const = 0;  // for reads
};

class Request;

// One worker's part of a request: a stretch of the body, and the edges when it holds them.
struct Slice {
    Request* req = nullptr;
    SlicePlan plan;
    size_t cursor = 0;       // next body byte to issue
    unsigned outstanding = 0;
    bool queued = false;     // in its worker's active list
    bool finished = false;
};

class Request final : public PendingRequest {
public:
    char* mem = nullptr;                     // host memory, or null when copier is set
    std::shared_ptr<const Copier> copier;
    int body_fd = -1;
    bool direct = false;
    bool staged = false;
    std::vector<Slice> slices;
    std::atomic<unsigned> slices_left{0};

    std::string verify() override;  // verify.cpp
};

}  // namespace dnv
