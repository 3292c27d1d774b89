// Device memory registered with cuFile (cuFileBufRegister), process-wide: a buffer pinned through one
// gds_handle is used as registered by every other. Registration is what lets true GPUDirect DMA go straight
// into the buffer; unregistered memory still works (cuFile bounces it through its own pinned buffers).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

namespace dnv::gds {

class DeviceBuffers {
public:
    // Where a span of device memory sits for cuFileRead/cuFileWrite: the registered base and the span's offset
    // from it, or {ptr, 0} when unregistered. `lease` keeps the registration from being dropped mid-transfer.
    struct Placement {
        const void* base = nullptr;
        size_t offset = 0;
        bool registered = false;
        std::shared_ptr<const void> lease;
    };

    static DeviceBuffers& instance();
    DeviceBuffers() = default;  // instance() is the one meant for use; public only for make_unique

    // Registers [ptr, ptr+len) on `device` with cuFile. `keepalive` holds the memory until unpin.
    // Returns a token for unpin_token(). Throws ArgError for overlaps, UnsupportedError for cuFile's refusal.
    uint64_t pin(int device, void* ptr, size_t len, std::shared_ptr<void> keepalive);
    // Deregisters the region based at `ptr`. False when none is. Throws ArgError while I/O uses it.
    bool unpin(const void* ptr);
    // Deregisters the region `token` names, if still registered; never throws (used by tensor deleters).
    void unpin_token(uint64_t token) noexcept;

    // Throws ArgError when the span starts inside a region but runs past its end.
    Placement place(int device, const void* ptr, size_t len) const;
    bool contains(const void* ptr, size_t len) const;

private:
    struct Region {
        int device;
        size_t len;
        uint64_t token;
        std::shared_ptr<void> keepalive;
        std::shared_ptr<const void> lease;  // one copy per in-flight request, plus this one
    };
    void deregister(uintptr_t base, Region& r);  // caller holds mu_

    mutable std::mutex mu_;
    std::map<uintptr_t, Region> regions_;  // base -> region; regions never overlap
    uint64_t next_token_ = 0;
};

}  // namespace dnv::gds
