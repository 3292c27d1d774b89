#include "device_buffers.h"

#include <string>

#include "cufile_api.h"
#include "error.h"

namespace dnv::gds {

DeviceBuffers& DeviceBuffers::instance() {
    // Never destroyed: at process exit the CUDA runtime and cuFile may already be torn down, and
    // deregistering (or freeing the tensors held here) then would crash instead of doing anything useful.
    static DeviceBuffers* const self = std::make_unique<DeviceBuffers>().release();
    return *self;
}

uint64_t DeviceBuffers::pin(int device, void* ptr, size_t len, std::shared_ptr<void> keepalive) {
    if (ptr == nullptr || len == 0) throw ArgError("cannot pin an empty device tensor");
    auto b = reinterpret_cast<uintptr_t>(ptr);
    std::lock_guard<std::mutex> lock(mu_);
    auto next = regions_.lower_bound(b);
    if (next != regions_.end() && next->first < b + len)
        throw ArgError(next->first == b ? "device tensor is already pinned (unpin it first)"
                                        : "device tensor overlaps memory that is already pinned");
    if (next != regions_.begin()) {
        auto prev = std::prev(next);
        if (prev->first + prev->second.len > b) throw ArgError("device tensor overlaps memory that is already pinned");
    }
    {
        DeviceGuard guard(device);
        CUfileError_t st = cuFileBufRegister(ptr, len, 0);
        if (st.err != CU_FILE_SUCCESS)
            throw UnsupportedError("cuFileBufRegister of " + std::to_string(len) + " bytes on cuda:" +
                                   std::to_string(device) + " failed: " + cufile_error_text(st));
    }
    uint64_t token = ++next_token_;
    regions_.emplace(b, Region{device, len, token, std::move(keepalive), std::make_shared<int>(0)});
    return token;
}

void DeviceBuffers::deregister(uintptr_t base, Region& r) {
    DeviceGuard guard(r.device);
    CUfileError_t st = cuFileBufDeregister(reinterpret_cast<const void*>(base));
    if (st.err != CU_FILE_SUCCESS)
        throw UnsupportedError("cuFileBufDeregister failed: " + cufile_error_text(st));
}

bool DeviceBuffers::unpin(const void* ptr) {
    std::shared_ptr<void> keepalive;  // released after the lock: dropping a tensor may run torch code
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regions_.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == regions_.end()) return false;
    if (it->second.lease.use_count() > 1)
        throw ArgError("device tensor has I/O in flight: wait() for it before unpinning");
    Region r = std::move(it->second);
    regions_.erase(it);
    keepalive = std::move(r.keepalive);
    deregister(reinterpret_cast<uintptr_t>(ptr), r);  // the region is forgotten even if cuFile complains
    return true;
}

void DeviceBuffers::unpin_token(uint64_t token) noexcept {
    std::shared_ptr<void> keepalive;  // released after the lock, as in unpin()
    try {
        std::lock_guard<std::mutex> lock(mu_);
        for (auto it = regions_.begin(); it != regions_.end(); ++it) {
            if (it->second.token != token) continue;
            Region r = std::move(it->second);
            uintptr_t base = it->first;
            regions_.erase(it);
            keepalive = std::move(r.keepalive);
            deregister(base, r);
            return;
        }
    } catch (const std::exception&) {
        // Called from a tensor's deleter: there is nobody to tell, and the memory goes back to torch anyway.
    }
}

DeviceBuffers::Placement DeviceBuffers::place(int device, const void* ptr, size_t len) const {
    auto p = reinterpret_cast<uintptr_t>(ptr);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regions_.upper_bound(p);
    if (it != regions_.begin()) {
        --it;
        const Region& r = it->second;
        if (p < it->first + r.len && r.device == device) {
            if (p + len > it->first + r.len)
                throw ArgError("device buffer starts inside a pinned region but runs " +
                               std::to_string(p + len - (it->first + r.len)) + " bytes past its end");
            return Placement{reinterpret_cast<const void*>(it->first), p - it->first, true, r.lease};
        }
    }
    return Placement{ptr, 0, false, nullptr};
}

bool DeviceBuffers::contains(const void* ptr, size_t len) const {
    auto p = reinterpret_cast<uintptr_t>(ptr);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regions_.upper_bound(p);
    if (it == regions_.begin()) return false;
    --it;
    return p + len <= it->first + it->second.len;
}

}  // namespace dnv::gds
