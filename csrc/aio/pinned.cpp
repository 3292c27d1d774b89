#include "pinned.h"

#include <Python.h>
#include <sys/mman.h>

#include <cerrno>
#include <cstdlib>
#include <memory>
#include <new>

#include "file.h"

namespace dnv {

PinnedRegistry::Allocation PinnedRegistry::allocate(size_t bytes) {
    const size_t page = page_size();
    size_t rounded = bytes == 0 ? page : (bytes + page - 1) / page * page;
    // Large buffers sit on 2 MiB boundaries and ask for transparent huge pages: the kernel then pins a
    // few huge pages per transfer instead of hundreds of small ones.
    constexpr size_t kHuge = 2u << 20;
    size_t align = rounded >= kHuge ? kHuge : page;
    void* p = nullptr;
    if (::posix_memalign(&p, align, rounded) != 0 || p == nullptr) throw std::bad_alloc();
    if (align == kHuge) ::madvise(p, rounded / kHuge * kHuge, MADV_HUGEPAGE);  // advice only: ignore refusal
    Allocation a{p, true, 0};
    if (::mlock(p, rounded) != 0) {
        a.locked = false;
        a.lock_errno = errno;
    }
    std::lock_guard<std::mutex> lock(mu_);
    regions_[reinterpret_cast<uintptr_t>(p)] = {rounded, a.locked};
    return a;
}

bool PinnedRegistry::forget(const void* base) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regions_.find(reinterpret_cast<uintptr_t>(base));
    if (it == regions_.end()) return false;
    if (it->second.locked) ::munlock(base, it->second.bytes);
    regions_.erase(it);
    return true;
}

void PinnedRegistry::release(void* base) {
    forget(base);
    std::free(base);
}

bool PinnedRegistry::contains(const void* p, size_t len) const {
    uintptr_t a = reinterpret_cast<uintptr_t>(p);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regions_.upper_bound(a);
    if (it == regions_.begin()) return false;
    --it;
    return a >= it->first && a + len <= it->first + it->second.bytes;
}

size_t PinnedRegistry::registered_bytes() const {
    std::lock_guard<std::mutex> lock(mu_);
    size_t total = 0;
    for (const auto& [base, r] : regions_) total += r.bytes;
    return total;
}

namespace {
PinnedRegistry* g_registry = nullptr;
constexpr const char* kAttr = "_deepnvme_pinned_registry_v1";
}  // namespace

void attach_shared_registry() {
    if (g_registry != nullptr) return;
    // The registry lives as long as the process: modules are never unloaded, and freeing it at exit
    // would race with tensors that are still alive then.
    PyObject* sys = PyImport_AddModule("sys");  // borrowed
    PyObject* existing = sys ? PyObject_GetAttrString(sys, kAttr) : nullptr;
    if (existing != nullptr && PyCapsule_CheckExact(existing)) {
        g_registry = static_cast<PinnedRegistry*>(PyCapsule_GetPointer(existing, kAttr));
        Py_DECREF(existing);
        if (g_registry != nullptr) return;
    }
    Py_XDECREF(existing);
    PyErr_Clear();
    auto owned = std::make_unique<PinnedRegistry>();
    PyObject* capsule = PyCapsule_New(owned.get(), kAttr, nullptr);
    if (capsule != nullptr && sys != nullptr && PyObject_SetAttrString(sys, kAttr, capsule) == 0) {
        g_registry = owned.release();
    } else {
        PyErr_Clear();
        g_registry = owned.release();  // unshared, but still correct within this module
    }
    Py_XDECREF(capsule);
}

PinnedRegistry& shared_registry() {
    if (g_registry == nullptr) attach_shared_registry();
    return *g_registry;
}

}  // namespace dnv
