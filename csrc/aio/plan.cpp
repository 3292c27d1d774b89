#include "plan.h"

namespace dnv {
namespace {

size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }
size_t align_down(size_t v, size_t a) { return v / a * a; }

void split_body(RequestPlan& plan, size_t begin, size_t end, size_t granule, unsigned parallelism,
                size_t min_slice) {
    size_t len = end - begin;
    size_t want = len / (min_slice > granule ? min_slice : granule);
    unsigned k = want == 0 ? 1u : (want < parallelism ? static_cast<unsigned>(want) : parallelism);
    size_t per = align_up((len + k - 1) / k, granule);
    for (size_t at = begin; at < end; at += per) {
        SlicePlan s;
        s.body_begin = at;
        s.body_end = at + per < end ? at + per : end;
        plan.slices.push_back(s);
    }
}

}  // namespace

RequestPlan plan_request(uintptr_t mem, size_t nbytes, uint64_t file_offset, bool direct, bool host_memory,
                         const Alignment& align, unsigned parallelism, size_t min_slice) {
    RequestPlan plan;
    if (nbytes == 0) return plan;
    size_t page = page_size();
    size_t granule = align.off > page ? align.off : page;
    if (!direct) {
        plan.staged = !host_memory;  // device memory reaches a buffered descriptor through host buffers too
        split_body(plan, 0, nbytes, granule, parallelism, min_slice);
        return plan;
    }
    // Body: the largest stretch whose file offsets start and end on a page (and the device's alignment).
    // The device would take 512-byte boundaries, but the page cache works in pages: a buffered edge of this
    // request loads and dirties its whole page, and if a neighbouring request's O_DIRECT write covers the
    // rest of that page while it is dirty, the kernel cannot drop the page and its later writeback puts the
    // old bytes back over the direct write. Edges that end on page boundaries never share a page with
    // anyone's direct I/O.
    size_t body_begin = static_cast<size_t>(align_up(file_offset, granule) - file_offset);
    size_t body_end = static_cast<size_t>(align_down(file_offset + nbytes, granule) - file_offset);
    if (body_begin >= body_end || body_begin >= nbytes) {
        SlicePlan s;  // too small to have an aligned body: all of it is one buffered edge
        s.head_end = nbytes;
        plan.slices.push_back(s);
        plan.has_edges = true;
        return plan;
    }
    plan.staged = !host_memory || (mem + body_begin) % (align.mem ? align.mem : 1) != 0;
    split_body(plan, body_begin, body_end, granule, parallelism, min_slice);
    plan.slices.front().head_end = body_begin;
    plan.slices.back().tail_begin = body_end;
    plan.slices.back().tail_end = nbytes;
    plan.has_edges = body_begin > 0 || body_end < nbytes;
    return plan;
}

}  // namespace dnv
