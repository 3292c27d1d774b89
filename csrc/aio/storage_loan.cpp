#include "storage_loan.h"

#include <Python.h>

#include <ATen/MapAllocator.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/impl/COW.h>

#include <cstring>
#include <mutex>
#include <unordered_map>
#include <utility>

namespace dnv {
namespace {

using Lent = std::shared_ptr<c10::DataPtr>;

// torch.multiprocessing's sharing strategy, which decides what share_memory_() keeps in place.
enum class SharingStrategy { kFileDescriptor, kFileSystem };

// The process's loans, whichever op took them. Both the aio and the gds op carry this file: with a table of
// loans each, a storage with requests in both would get a stand-in over a stand-in, and the first op to end
// its loans would put back a stand-in (or lift the resize freeze) under the other's pending request. So the
// first copy to be asked publishes its functions under kModule in sys.modules, and every copy uses those.
// Bump the version with any change to this struct or to what a stand-in's context holds.
struct LoanTable {
    Lent (*begin)(c10::StorageImpl*);
    void (*end)(c10::StorageImpl*);
    const c10::DataPtr* (*owning)(const c10::DataPtr*);
};
constexpr const char* kModule = "_deepnvme_storage_loans_v1";
constexpr const char* kCapsule = "_deepnvme_storage_loans_v1.table";

// The stand-in's deleter: its context is one reference to the lent original.
void release_stand_in(void* ctx) { delete static_cast<Lent*>(ctx); }

bool is_stand_in(const c10::DataPtr& d) { return d.get_deleter() == &release_stand_in; }

SharingStrategy sharing_strategy() {
    // torch imports torch.multiprocessing itself; its absence (or any failure) means torch's default.
    PyObject* mp = PyDict_GetItemString(PyImport_GetModuleDict(), "torch.multiprocessing");
    PyObject* s = mp != nullptr ? PyObject_CallMethod(mp, "get_sharing_strategy", nullptr) : nullptr;
    const char* name = s != nullptr && PyUnicode_Check(s) ? PyUnicode_AsUTF8(s) : nullptr;
    const bool file_system = name != nullptr && std::strcmp(name, "file_system") == 0;
    Py_XDECREF(s);
    PyErr_Clear();
    return file_system ? SharingStrategy::kFileSystem : SharingStrategy::kFileDescriptor;
}

// Whether share_memory_() could replace this host memory. It keeps memory the current strategy shares from
// (MapAllocator's for file descriptors, RefcountedMapAllocator's for file names), which must keep its own
// DataPtr for share_memory_() to recognise it, and copies anything else into new shared memory. A
// copy-on-write DataPtr is torch's to swap. Pinned memory is lent like any other: its caching allocator
// finds a block by address when the DataPtr's context is not one of its own (record_event of a
// non_blocking copy), and frees it only through the original DataPtr.
bool lendable(const c10::DataPtr& d) {
    if (d.get() == nullptr || !d.device().is_cpu() || c10::impl::cow::is_cow_data_ptr(d)) return false;
    const bool by_fd = at::MapAllocator::fromDataPtr(d) != nullptr;
    const bool by_name = at::RefcountedMapAllocator::fromDataPtr(d) != nullptr;
    if (by_fd || by_name) return (sharing_strategy() == SharingStrategy::kFileSystem) ? by_fd : by_name;
    return true;
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

Lent begin_loan(c10::StorageImpl* s) {
    // Whatever can throw comes before anything changes: a failed loan leaves the storage as it was.
    const c10::DataPtr& d = s->data_ptr();
    Lent memory;
    std::unique_ptr<Lent> ref;  // the stand-in's reference, if this call installs one
    if (is_stand_in(d)) {
        memory = *static_cast<Lent*>(d.get_context());
    } else if (lendable(d)) {
        memory = std::make_shared<c10::DataPtr>();
        ref = std::make_unique<Lent>(memory);
    }
    std::lock_guard<std::mutex> lock(registry_mu());
    Entry& e = registry()[s];
    if (e.loans++ == 0) {
        e.thaw = s->resizable();
        if (e.thaw) s->set_resizable(false);
    }
    if (ref) {
        c10::DataPtr stand_in(d.get(), ref.get(), &release_stand_in, d.device());
        (void)ref.release();  // the stand-in owns it now
        *memory = s->set_data_ptr(std::move(stand_in));
    }
    return memory;
}

void end_loan(c10::StorageImpl* s) {
    Lent back;  // the original, kept until after the lock: if it is the last reference its deleter runs
    std::lock_guard<std::mutex> lock(registry_mu());
    auto it = registry().find(s);
    if (it == registry().end() || --it->second.loans > 0) return;
    // Only with an allocator to resize with: share_memory_() meanwhile leaves the storage without one, and
    // torch refuses (throws) to make such a storage resizable.
    if (it->second.thaw && s->allocator() != nullptr) s->set_resizable(true);
    registry().erase(it);
    const c10::DataPtr& d = s->data_ptr();
    if (is_stand_in(d)) {
        back = *static_cast<Lent*>(d.get_context());
        s->set_data_ptr_noswap(std::move(*back));  // destroys the stand-in; the memory stays in place
    }
}

const c10::DataPtr* owning_of(const c10::DataPtr* d) {
    return is_stand_in(*d) ? static_cast<Lent*>(d->get_context())->get() : d;
}

// The process's table (see LoanTable). Called with the GIL held, which orders the first calls: nothing here
// runs Python code or imports, so the GIL is not given up between looking for a table and publishing one.
const LoanTable& table() {
    static const LoanTable own{&begin_loan, &end_loan, &owning_of};
    static const LoanTable* found = nullptr;
    if (found != nullptr) return *found;
    PyObject* modules = PyImport_GetModuleDict();
    if (PyObject* mod = PyDict_GetItemString(modules, kModule)) {
        PyObject* capsule = PyObject_GetAttrString(mod, "table");
        void* p = capsule != nullptr ? PyCapsule_GetPointer(capsule, kCapsule) : nullptr;
        Py_XDECREF(capsule);
        PyErr_Clear();
        if (p != nullptr) return *(found = static_cast<const LoanTable*>(p));
    }
    PyObject* mod = PyModule_New(kModule);
    PyObject* capsule = PyCapsule_New(const_cast<LoanTable*>(&own), kCapsule, nullptr);
    if (mod != nullptr && capsule != nullptr && PyModule_AddObjectRef(mod, "table", capsule) == 0)
        (void)PyDict_SetItemString(modules, kModule, mod);
    Py_XDECREF(capsule);
    Py_XDECREF(mod);
    PyErr_Clear();  // unpublished (out of memory): this copy's loans stay consistent among themselves
    return *(found = &own);
}

}  // namespace

StorageLoan::StorageLoan(c10::Storage storage) : storage_(std::move(storage)) {
    if (c10::StorageImpl* s = storage_.unsafeGetStorageImpl()) memory_ = table().begin(s);
}

StorageLoan::~StorageLoan() {
    if (c10::StorageImpl* s = storage_.unsafeGetStorageImpl()) table().end(s);
}

const c10::DataPtr& owning_data_ptr(const c10::DataPtr& d) { return *table().owning(&d); }

}  // namespace dnv
