#include "staging.h"

#include <sys/mman.h>

#include <new>

namespace dnv {

StagingPool::~StagingPool() {
    if (base_ == nullptr) return;
    if (locked_) ::munlock(base_, bytes_);
    ::munmap(base_, bytes_);
}

int StagingPool::acquire() {
    if (base_ == nullptr) {
        bytes_ = buffer_bytes_ * count_;
        void* p = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) throw std::bad_alloc();
        base_ = static_cast<char*>(p);
        // Locking is an optimisation (no page faults mid-transfer); an RLIMIT_MEMLOCK refusal is harmless.
        locked_ = ::mlock(base_, bytes_) == 0;
        free_.reserve(count_);
        for (size_t i = count_; i > 0; --i) free_.push_back(static_cast<int>(i - 1));
    }
    if (free_.empty()) return -1;
    int i = free_.back();
    free_.pop_back();
    return i;
}

std::vector<void*> StagingPool::buffers() const {
    std::vector<void*> out;
    for (size_t i = 0; i < count_; ++i) out.push_back(data(static_cast<int>(i)));
    return out;
}

}  // namespace dnv
