#include "aligned_tensor.h"

#include <ATen/ops/empty.h>
#include <c10/core/StorageImpl.h>

#include <cstdlib>
#include <new>
#include <string>

#include "error.h"
#include "file.h"
#include "storage_loan.h"

namespace dnv {
namespace {

// Frees what aligned_block() returned; the DataPtr's context is the block, its data may lie inside it.
void free_block(void* block) { std::free(block); }

void* aligned_block(size_t nbytes) {
    void* p = nullptr;
    // posix_memalign of 0 bytes may return NULL: ask for one page at least so a pointer always comes back.
    if (::posix_memalign(&p, page_size(), nbytes ? nbytes : 1) != 0) throw std::bad_alloc();
    return p;
}

// A non-resizable uint8 tensor over `data` (like the storages torch.load makes: PyTorchStreamReader's records).
at::Tensor tensor_over(c10::DataPtr data, int64_t nbytes) {
    auto storage = c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), nbytes,
                                                         std::move(data), /*allocator=*/nullptr,
                                                         /*resizable=*/false);
    at::Tensor t = at::empty({0}, at::TensorOptions().dtype(at::kByte));
    t.set_(c10::Storage(std::move(storage)), 0, {nbytes}, {1});
    return t;
}

void check_sizes(int64_t nbytes, int64_t residue) {
    const auto page = static_cast<int64_t>(page_size());
    if (nbytes < 0) throw ArgError("nbytes must be >= 0, got " + std::to_string(nbytes));
    if (residue < 0 || residue >= page)
        throw ArgError("residue must be in [0, " + std::to_string(page) + "), got " + std::to_string(residue));
}

}  // namespace

at::Tensor empty_at_residue(int64_t nbytes, int64_t residue) {
    check_sizes(nbytes, residue);
    const size_t total = static_cast<size_t>(nbytes) + static_cast<size_t>(residue);
    void* block = aligned_block(total);
    return tensor_over(c10::DataPtr(static_cast<char*>(block) + residue, block, &free_block,
                                    c10::Device(c10::DeviceType::CPU)),
                       nbytes);
}

at::Tensor empty_fresh(int64_t nbytes, int64_t residue) {
    check_sizes(nbytes, residue);
    FreshBlock* b = fresh_allocate(static_cast<size_t>(nbytes), static_cast<size_t>(residue));
    return tensor_over(c10::DataPtr(b->base + residue, b, &fresh_free, c10::Device(c10::DeviceType::CPU)),
                       nbytes);
}

FreshBlock* fresh_block_of(const at::Tensor& t) {
    if (!t.defined() || !t.has_storage() || !t.device().is_cpu()) return nullptr;
    const c10::DataPtr& d = owning_data_ptr(t.storage().data_ptr());  // a pending request's tensor is lent
    return d.get_deleter() == &fresh_free ? static_cast<FreshBlock*>(d.get_context()) : nullptr;
}

}  // namespace dnv
