// Host tensors whose memory sits at a chosen offset from a page boundary, so that the handle can read a
// file range straight into them with O_DIRECT (it goes zero-copy when memory and file offset agree modulo
// the page size). deepnvme.load restores each checkpoint storage into one of these.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace dnv {

// A uint8 tensor of `nbytes` whose first byte lies `residue` bytes past a page boundary (0 <= residue <
// page size). Its storage owns the memory and, like those torch.load makes, is not resizable. Throws ArgError for bad sizes, std::bad_alloc without memory.
at::Tensor empty_at_residue(int64_t nbytes, int64_t residue);

}  // namespace dnv
