// Host tensors whose memory sits at a chosen offset from a page boundary, so that the handle can read a
// file range straight into them with O_DIRECT (it goes zero-copy when memory and file offset agree modulo
// the page size), or fill them through userfaultfd without their pages being zeroed first (fresh_memory.h).
// deepnvme.load restores each checkpoint storage into one of these.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "fresh_memory.h"

namespace dnv {

// A uint8 tensor of `nbytes` whose first byte lies `residue` bytes past a page boundary (0 <= residue <
// page size). Its storage owns the memory and, like those torch.load makes, is not resizable. Throws ArgError
// for bad sizes, std::bad_alloc without memory.
at::Tensor empty_at_residue(int64_t nbytes, int64_t residue);

// The same over a FreshBlock: a read into it goes staged and fills its armed pages without zeroing them
// (fresh_memory.h); settle_fresh() makes it plain memory once the reads are done.
at::Tensor empty_fresh(int64_t nbytes, int64_t residue);

// The FreshBlock under a tensor's memory, or nullptr when the tensor's storage is not one.
FreshBlock* fresh_block_of(const at::Tensor& t);

}  // namespace dnv
