// Process-wide registry of locked (page-aligned, mlocked) host regions. Every aio handle, gds handle and
// pin_handle in the process shares one registry, even across separately built extension modules.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>

namespace dnv {

class PinnedRegistry {
public:
    // What locking achieved: false when mlock was refused (RLIMIT_MEMLOCK) and the memory is unlocked.
    struct Allocation {
        void* ptr;
        bool locked;
        int lock_errno;
    };

    // Allocates `bytes` page-aligned (rounded up to a page), tries to mlock, registers it.
    // Throws std::bad_alloc when memory cannot be had at all.
    virtual Allocation allocate(size_t bytes);
    // Unregisters and unlocks a region by its base; the memory itself is released by release().
    // Returns false when `base` is not the base of a registered region.
    virtual bool forget(const void* base);
    // Frees memory from allocate(); forgets it first if still registered. Safe from any thread.
    virtual void release(void* base);
    // True when [p, p+len) lies inside one registered region.
    virtual bool contains(const void* p, size_t len) const;
    // Bytes currently registered (for leak checks).
    virtual size_t registered_bytes() const;

    virtual ~PinnedRegistry() = default;
    // Layout version of this class; modules with another version do not share (they get their own).
    static constexpr int kVersion = 1;

private:
    struct Region {
        size_t bytes;
        bool locked;
    };
    mutable std::mutex mu_;
    std::map<uintptr_t, Region> regions_;  // base -> region
};

// The process-wide registry. attach_shared_registry() must run once (module init, GIL held) before use.
PinnedRegistry& shared_registry();

// Finds the registry another module already published, or creates and publishes one (needs the GIL).
void attach_shared_registry();

}  // namespace dnv
