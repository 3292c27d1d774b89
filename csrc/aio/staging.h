// A worker's reusable pool of page-aligned, locked bounce buffers, for memory that cannot go to O_DIRECT
// as it is (unaligned host memory, device memory). Allocated once on first use, never per request.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

namespace dnv {

class StagingPool {
public:
    StagingPool(size_t buffer_bytes, size_t count) : buffer_bytes_(buffer_bytes), count_(count) {}
    ~StagingPool();
    StagingPool(const StagingPool&) = delete;
    StagingPool& operator=(const StagingPool&) = delete;

    // Index of a free buffer, or -1 when all are in use. Allocates the pool on first call (may throw).
    int acquire();
    void release(int index) { free_.push_back(index); }
    char* data(int index) const { return base_ + static_cast<size_t>(index) * buffer_bytes_; }
    size_t buffer_bytes() const noexcept { return buffer_bytes_; }
    size_t count() const noexcept { return count_; }
    bool allocated() const noexcept { return base_ != nullptr; }
    std::vector<void*> buffers() const;

private:
    size_t buffer_bytes_, count_;
    char* base_ = nullptr;
    size_t bytes_ = 0;
    bool locked_ = false;
    std::vector<int> free_;
};

}  // namespace dnv
