// Memory new to the process that a staged read fills without the kernel zeroing its pages first.
//
// Why: the kernel hands out every new anonymous page zeroed, on the first touch of whoever writes it. For a
// load into new memory that zeroing, and the fault around it, costs about as much CPU as the copy that then
// overwrites the page, so a load into new memory ran well below the same load into memory made before
// (bench/ckpt_bench.py measures both). userfaultfd's UFFDIO_COPY makes a missing page and fills it from a
// source in one step, with no zeroing and no fault. So a FreshBlock is an anonymous mapping registered with
// the process's userfaultfd ("armed"); a staged read's copy-out fills its pages through it (FreshCopier);
// settle() then unregisters it, leaving plain anonymous memory like any other. The whole mapping is
// registered, so that neighbouring blocks' mappings merge (one each would reach vm.max_map_count on a
// checkpoint of tens of thousands of tensors), and its partial first and last pages, which only the caller
// writes, are made (zeroed) at once.
//
// Safety, whatever touches an armed page first:
// - fill() never overwrites a page that is present already (UFFDIO_COPY refuses with EEXIST): such pages, and
//   whatever UFFDIO_COPY refuses, are copied plainly.
// - A touch from user space of an armed page not filled yet (a bug, a debugger, an early read) faults, and a
//   thread of the op's answers it with a zeroed page, as the kernel would have: no hang, no signal.
// - A system call that reads or writes such a page (read(2) into it, write(2) from it) is served the same way
//   where the process may handle kernel faults (CAP_SYS_PTRACE, or vm.unprivileged_userfaultfd=1); elsewhere
//   the userfaultfd is for user-mode faults only (UFFD_USER_MODE_ONLY) and the call fails with EFAULT. So
//   memory is settled before it leaves the code that fills it (deepnvme.load settles before it returns), and
//   every read into armed memory is staged (the copier), so the kernel never writes into it.
// - A forked child closes the inherited descriptor at once (its ioctls would act on the parent's memory); its
//   copies of armed blocks are plain memory (the registration is not inherited without
//   UFFD_FEATURE_EVENT_FORK), and it opens a userfaultfd of its own on first use.
// Where userfaultfd is unavailable (an old kernel, a seccomp filter, no permission) or DEEPNVME_FILL_FRESH=0
// (for a seccomp filter that kills a process calling userfaultfd(2) rather than refusing it), blocks are
// plain mappings, never armed, and fill() is a plain copy: the same bytes, at the zeroing's cost.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "request.h"

namespace dnv {

struct FreshBlock {
    char* base = nullptr;  // the mapping, whole pages, all of it registered while armed
    size_t len = 0;
    std::atomic<bool> armed{false};
    unsigned long generation = 0;  // the process generation (fork bumps it) whose userfaultfd armed the block
};

// "ok" when new blocks can be armed in this process, else why not (the errno text of what failed).
std::string fresh_memory_status();

// A mapping holding `nbytes` starting `residue` bytes past its first page, armed where userfaultfd is
// available. Throws std::bad_alloc when the memory cannot be had.
FreshBlock* fresh_allocate(size_t nbytes, size_t residue);

// Unmaps a block from fresh_allocate (a DataPtr deleter: its argument is the block).
void fresh_free(void* block);

// Copies n bytes from src to dst (inside the block): the armed whole pages through UFFDIO_COPY, the rest plainly.
void fresh_fill(FreshBlock& block, char* dst, const char* src, size_t n);

// Unregisters the block: from now on it is plain memory. Idempotent; what was not filled reads as zero. Where
// the kernel refuses, the block stays armed (and safe, as above).
void fresh_settle(FreshBlock& block);

// The copier of a read into an armed block: the handle stages the read, then fills the block from its staging
// buffers (a request with a copier is always staged, and never has the kernel write into its memory).
class FreshCopier final : public Copier {
public:
    FreshCopier(FreshBlock* block, char* mem) : block_(block), mem_(mem) {}
    void to_host(void* dst, size_t offset, size_t len) const override;
    void from_host(size_t offset, const void* src, size_t len) const override;

private:
    FreshBlock* block_;  // kept alive by the request's loan of the tensor's memory (storage_loan.h)
    char* mem_;
};

}  // namespace dnv
