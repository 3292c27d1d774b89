// Memory new to the process that a staged read fills without the kernel zeroing its pages first.
//
// Why: the kernel hands out every new anonymous page zeroed, on the first touch of whoever writes it. For a
// load into new memory that zeroing, and the fault around it, costs about as much CPU as the copy that then
// overwrites the page, so a load into new memory ran at half the speed of the same load into memory made
// before (bench/ckpt_bench.py measures both). userfaultfd's UFFDIO_COPY makes a missing page and fills it
// from a source in one step, with no zeroing and no fault. So a FreshBlock is an anonymous mapping whose whole
// pages are registered with the process's userfaultfd ("armed"); a staged read's copy-out fills them through
// it (FreshCopier); settle() then unregisters them, leaving plain anonymous memory like any other.
//
// Safety, whatever touches an armed page first:
// - fill() never overwrites a page that is present already (UFFDIO_COPY refuses with EEXIST): such pages, and
//   whatever UFFDIO_COPY refuses, are copied plainly.
// - Anything else that touches an armed page before it is filled (a bug, a debugger, an early read) faults; a
//   server thread answers the fault with a zeroed page, as the kernel would have: no hang, no signal.
// - A forked child's mappings are not registered (the userfaultfd context is not inherited without
//   UFFD_FEATURE_EVENT_FORK), and the child never uses the parent's descriptor, whose ioctls would act on the
//   parent's memory: it opens its own on first use.
// Where userfaultfd is unavailable (an old kernel, a seccomp filter, no permission), blocks are plain
// mappings, never armed, and fill() is a plain copy: the same bytes, at the zeroing's cost.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "request.h"

namespace dnv {

struct FreshBlock {
    char* base = nullptr;  // the mapping, whole pages
    size_t len = 0;
    // The registered whole pages, [armed_begin, armed_end), while armed.
    uintptr_t armed_begin = 0;
    uintptr_t armed_end = 0;
    std::atomic<bool> armed{false};
    long owner = 0;  // the process (pid) whose userfaultfd armed the block
};

// "ok" when new blocks can be armed in this process, else why not (the errno text of what failed).
std::string fresh_memory_status();

// A mapping holding `nbytes` starting `residue` bytes past its first page, its whole pages within those bytes
// armed where userfaultfd is available. Throws std::bad_alloc when the memory cannot be had.
FreshBlock* fresh_allocate(size_t nbytes, size_t residue);

// Unmaps a block from fresh_allocate (a DataPtr deleter: its argument is the block).
void fresh_free(void* block);

// Copies n bytes from src to dst (inside the block): the armed whole pages through UFFDIO_COPY, the rest plainly.
void fresh_fill(FreshBlock& block, char* dst, const char* src, size_t n);

// Unregisters the block's pages: from now on it is plain memory. Idempotent; what was not filled reads as zero.
void fresh_settle(FreshBlock& block);

// The copier of a read into an armed block: the handle stages the read, then fills the block from its staging
// buffers (a request with a copier is always staged, and never has the kernel write into its memory).
class FreshCopier final : public Copier {
public:
    FreshCopier(FreshBlock* block, char* mem) : block_(block), mem_(mem) {}
    void to_host(void* dst, size_t offset, size_t len) const override;
    void from_host(size_t offset, const void* src, size_t len) const override;

private:
    FreshBlock* block_;  // kept alive by the request's hold on the tensor
    char* mem_;
};

}  // namespace dnv
