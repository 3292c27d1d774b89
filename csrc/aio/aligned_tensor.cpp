#include "aligned_tensor.h"

#include <ATen/ops/empty.h>
#include <c10/core/StorageImpl.h>
#include <sys/mman.h>

#include <limits>
#include <memory>
#include <new>
#include <string>

#include "error.h"
#include "file.h"

namespace dnv {
namespace {

// The pages of the shared mapping that one storage owns; they are unmapped when that storage dies, so
// every storage frees its own memory whatever becomes of the others.
struct Span {
    void* base;
    size_t len;
};

void unmap_span(void* ctx) {
    auto* s = static_cast<Span*>(ctx);
    ::munmap(s->base, s->len);
    delete s;
}

// Unmaps what no storage has taken yet if making the storages fails part-way.
struct MappingGuard {
    char* base;
    size_t len;
    size_t taken = 0;  // bytes from the start that storages own
    ~MappingGuard() {
        if (len > taken) ::munmap(base + taken, len - taken);
    }
};

at::Tensor tensor_over(c10::DataPtr data, int64_t nbytes) {
    // Like the storages torch.load makes (PyTorchStreamReader's records): no allocator, not resizable.
    auto storage = c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), nbytes,
                                                         std::move(data), /*allocator=*/nullptr,
                                                         /*resizable=*/false);
    at::Tensor t = at::empty({0}, at::TensorOptions().dtype(at::kByte));
    t.set_(c10::Storage(std::move(storage)), 0, {nbytes}, {1});
    return t;
}

}  // namespace

std::vector<at::Tensor> empty_at_residues(const std::vector<int64_t>& nbytes,
                                          const std::vector<int64_t>& residues) {
    const size_t page = page_size();
    if (nbytes.size() != residues.size())
        throw ArgError("nbytes and residues differ in length (" + std::to_string(nbytes.size()) + " and " +
                       std::to_string(residues.size()) + ")");
    std::vector<size_t> spans(nbytes.size());
    size_t total = 0;
    for (size_t i = 0; i < nbytes.size(); ++i) {
        if (nbytes[i] < 0) throw ArgError("nbytes must be >= 0, got " + std::to_string(nbytes[i]));
        if (residues[i] < 0 || residues[i] >= static_cast<int64_t>(page))
            throw ArgError("residue must be in [0, " + std::to_string(page) + "), got " +
                           std::to_string(residues[i]));
        const auto n = static_cast<uint64_t>(nbytes[i]) + static_cast<uint64_t>(residues[i]);
        if (n > std::numeric_limits<size_t>::max() - page - total) throw std::bad_alloc();
        spans[i] = n == 0 ? page : (n + page - 1) / page * page;  // a page at least: a distinct pointer
        total += spans[i];
    }
    std::vector<at::Tensor> out;
    if (total == 0) return out;
    out.reserve(nbytes.size());
    // One mapping for all of them: the kernel then faults their pages in as one region, which is what a
    // load's reads into fresh memory spend most of their CPU on.
    void* p = ::mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    MappingGuard guard{static_cast<char*>(p), total};
    for (size_t i = 0; i < nbytes.size(); ++i) {
        char* base = guard.base + guard.taken;
        auto span = std::make_unique<Span>(Span{base, spans[i]});
        c10::DataPtr data(base + residues[i], span.get(), &unmap_span, c10::Device(c10::DeviceType::CPU));
        span.release();  // the DataPtr owns it now
        guard.taken += spans[i];
        out.push_back(tensor_over(std::move(data), nbytes[i]));
    }
    return out;
}

at::Tensor empty_at_residue(int64_t nbytes, int64_t residue) {
    return empty_at_residues({nbytes}, {residue}).front();
}

}  // namespace dnv
