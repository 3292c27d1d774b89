// What a pending request holds of its tensor's storage, so that nothing the caller does to the tensor while
// the request is pending frees or moves the memory a worker is filling or reading:
// - The storage is made non-resizable: `untyped_storage().resize_()` raises instead of freeing the memory.
// - Its memory is lent to the request. The storage's DataPtr (the one whose deleter frees the memory) moves
//   into the loan, and the storage gets a stand-in at the same address whose deleter only lets go of the loan.
//   Code that replaces a storage's memory destroys the DataPtr it replaces: `share_memory_()` copies the
//   bytes into shared memory, swaps the DataPtr and destroys the old one. With the loan it destroys only the
//   stand-in, and the memory lives until the last request on it is handed over (a read then reports that
//   its tensor was given other memory). When a storage's last loan ends with the stand-in still in place, the
//   original goes back: outside pending requests nobody sees a stand-in.
// Not lent: memory share_memory_() keeps where it is under the sharing strategy in force (memory mapped by
// the allocator that strategy shares from, which share_memory_() recognises by its DataPtr), copy-on-write
// memory, and memory other than the host's.
// Loans are counted per storage (several pending requests may share one), in one table per process however
// many ops carry this file (the aio and gds ops both do), and taken and ended with the GIL held: Python code
// reads and replaces a storage's DataPtr under the GIL.
#pragma once

#include <c10/core/Storage.h>

#include <memory>

namespace dnv {

class StorageLoan {
public:
    explicit StorageLoan(c10::Storage storage);
    ~StorageLoan();
    StorageLoan(const StorageLoan&) = delete;
    StorageLoan& operator=(const StorageLoan&) = delete;

private:
    c10::Storage storage_;
    std::shared_ptr<c10::DataPtr> memory_;  // the lent original; null where the memory is not lent
};

// The DataPtr that owns a storage's memory: the original behind a loan's stand-in, else `d` itself.
const c10::DataPtr& owning_data_ptr(const c10::DataPtr& d);

}  // namespace dnv
