#include "storage_loan.h"

#include <ATen/Context.h>
#include <ATen/MapAllocator.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/impl/COW.h>

#include <mutex>
#include <unordered_map>
#include <utility>

namespace dnv {
namespace {

using Lent = std::shared_ptr<c10::DataPtr>;

// The stand-in's deleter: its context is one reference to the lent original.
void release_stand_in(void* ctx) { delete static_cast<Lent*>(ctx); }

bool is_stand_in(const c10::DataPtr& d) { return d.get_deleter() == &release_stand_in; }

bool lendable(const c10::DataPtr& d) {
    return d.get() != nullptr && d.device().is_cpu() && at::MapAllocator::fromDataPtr(d) == nullptr &&
           at::RefcountedMapAllocator::fromDataPtr(d) == nullptr && !c10::impl::cow::is_cow_data_ptr(d) &&
           !at::globalContext().isPinnedPtr(d.get());
}

struct Entry {
    unsigned loans = 0;
    bool thaw = false;  // the storage was resizable before its first loan
};

std::mutex& registry_mu() {
    static std::mutex m;
    return m;
}

std::unordered_map<c10::StorageImpl*, Entry>& registry() {
    static std::unordered_map<c10::StorageImpl*, Entry> r;
    return r;
}

}  // namespace

StorageLoan::StorageLoan(c10::Storage storage) : storage_(std::move(storage)) {
    c10::StorageImpl* s = storage_.unsafeGetStorageImpl();
    if (s == nullptr) return;
    std::lock_guard<std::mutex> lock(registry_mu());
    Entry& e = registry()[s];
    if (e.loans++ == 0) {
        e.thaw = s->resizable();
        if (e.thaw) s->set_resizable(false);
    }
    const c10::DataPtr& d = s->data_ptr();
    if (is_stand_in(d)) {
        memory_ = *static_cast<Lent*>(d.get_context());
    } else if (lendable(d)) {
        auto lent = std::make_shared<c10::DataPtr>();
        auto ref = std::make_unique<Lent>(lent);
        c10::DataPtr stand_in(d.get(), ref.get(), &release_stand_in, d.device());
        (void)ref.release();  // the stand-in owns it now
        *lent = s->set_data_ptr(std::move(stand_in));
        memory_ = std::move(lent);
    }
}

StorageLoan::~StorageLoan() {
    c10::StorageImpl* s = storage_.unsafeGetStorageImpl();
    if (s == nullptr) return;
    Lent back;  // the original, kept until after the lock: if it is the last reference its deleter runs
    {
        std::lock_guard<std::mutex> lock(registry_mu());
        auto it = registry().find(s);
        if (it == registry().end() || --it->second.loans > 0) return;
        // Only with an allocator to resize with: share_memory_() meanwhile leaves the storage without one,
        // and torch refuses (throws) to make such a storage resizable.
        if (it->second.thaw && s->allocator() != nullptr) s->set_resizable(true);
        registry().erase(it);
        const c10::DataPtr& d = s->data_ptr();
        if (is_stand_in(d)) {
            back = *static_cast<Lent*>(d.get_context());
            s->set_data_ptr_noswap(std::move(*back));  // destroys the stand-in; the memory stays in place
        }
    }
}

const c10::DataPtr& owning_data_ptr(const c10::DataPtr& d) {
    return is_stand_in(d) ? **static_cast<Lent*>(d.get_context()) : d;
}

}  // namespace dnv
