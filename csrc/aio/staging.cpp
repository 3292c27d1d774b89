#include "staging.h"

#include <sys/mman.h>

#include <memory>
#include <new>

#include "tunables.h"

namespace dnv {

StagingArena::StagingArena()
    : buffer_bytes_(tunables().staging_buffer_bytes), count_(tunables().staging_buffers) {}

StagingArena& StagingArena::shared() {
    // Deliberately never destroyed (see the header): no work runs in a static destructor.
    static StagingArena* arena = std::make_unique<StagingArena>().release();
    return *arena;
}

void StagingArena::allocate_locked() {
    if (base_ != nullptr) return;
    size_t bytes = buffer_bytes_ * count_;
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    base_ = static_cast<char*>(p);
    // Locking is an optimisation (no page faults mid-transfer); an RLIMIT_MEMLOCK refusal is harmless.
    (void)::mlock(base_, bytes);
    free_.reserve(count_);
    for (size_t i = count_; i > 0; --i) free_.push_back(static_cast<int>(i - 1));
}

int StagingArena::acquire() {
    std::lock_guard<std::mutex> lock(mu_);
    allocate_locked();
    if (free_.empty()) return -1;
    int i = free_.back();
    free_.pop_back();
    return i;
}

void StagingArena::release(int index) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(index);
}

std::vector<void*> StagingArena::buffers() {
    std::lock_guard<std::mutex> lock(mu_);
    allocate_locked();
    std::vector<void*> out;
    for (size_t i = 0; i < count_; ++i) out.push_back(data(static_cast<int>(i)));
    return out;
}

}  // namespace dnv
