// plan_request: how one request is cut into a buffered head and tail and per-thread aligned body slices.
#include <cstdint>
#include <random>

#include "check.h"
#include "file.h"
#include "plan.h"

using dnv::Alignment;
using dnv::plan_request;
using dnv::RequestPlan;

namespace {

constexpr size_t kKiB = 1024, kMiB = 1024 * 1024;

// Every rule a plan must keep, whatever its inputs: the pieces cover the request once, in order; body
// boundaries fall on the granule in the file; no more slices than threads, none below min_slice when split;
// staging exactly when the memory cannot go to O_DIRECT as it is.
void check_invariants(const RequestPlan& p, uintptr_t mem, size_t n, uint64_t off, bool direct, bool host,
                      const Alignment& a, unsigned parallelism, size_t min_slice) {
    if (n == 0) {
        CHECK(p.slices.empty());
        return;
    }
    CHECK(!p.slices.empty());
    if (p.slices.empty()) return;
    const size_t granule = a.off > dnv::page_size() ? a.off : dnv::page_size();
    CHECK(p.slices.size() <= (parallelism == 0 ? 1 : parallelism));
    const auto& first = p.slices.front();
    const auto& last = p.slices.back();
    CHECK_EQ(first.head_begin, size_t(0));
    size_t at = first.head_end;  // the next byte to be covered
    bool edges = first.head_end > first.head_begin;
    for (size_t i = 0; i < p.slices.size(); ++i) {
        const auto& s = p.slices[i];
        if (i > 0) CHECK(s.head_begin == s.head_end);
        if (i + 1 < p.slices.size()) CHECK(s.tail_begin == s.tail_end);
        if (s.body_begin == s.body_end) continue;
        CHECK_EQ(s.body_begin, at);
        CHECK(s.body_end > s.body_begin);
        if (direct) {
            CHECK_EQ((off + s.body_begin) % granule, uint64_t(0));
            CHECK_EQ((off + s.body_end) % granule, uint64_t(0));
        }
        if (p.slices.size() > 1 && i + 1 < p.slices.size()) CHECK(s.body_end - s.body_begin >= min_slice);
        at = s.body_end;
    }
    if (last.tail_end > last.tail_begin) {
        CHECK_EQ(last.tail_begin, at);
        at = last.tail_end;
        edges = true;
    }
    CHECK_EQ(at, n);
    CHECK_EQ(p.has_edges, edges);
    if (!direct) CHECK(!edges);
    const bool has_body = first.body_end > first.body_begin;
    if (!has_body) CHECK(p.slices.size() == 1 && first.head_end == n);
    if (has_body) {
        const bool want_staged =
            !host || (direct && (mem + first.body_begin) % (a.mem ? a.mem : 1) != 0);
        CHECK_EQ(p.staged, want_staged);
    }
}

}  // namespace

TEST(empty_request_has_no_slices) {
    RequestPlan p = plan_request(4096, 0, 0, true, true, Alignment{}, 4, 256 * kKiB);
    CHECK(p.slices.empty());
    CHECK(!p.staged && !p.has_edges);
}

TEST(aligned_request_splits_evenly_between_threads) {
    RequestPlan p = plan_request(1 << 20, 8 * kMiB, 0, true, true, Alignment{4096, 4096}, 4, 256 * kKiB);
    CHECK_EQ(p.slices.size(), size_t(4));
    CHECK(!p.staged && !p.has_edges);
    for (size_t i = 0; i < p.slices.size(); ++i) {
        CHECK_EQ(p.slices[i].body_begin, i * 2 * kMiB);
        CHECK_EQ(p.slices[i].body_end, (i + 1) * 2 * kMiB);
    }
}

TEST(unaligned_offset_gets_buffered_head_and_tail) {
    const size_t page = dnv::page_size();
    RequestPlan p = plan_request(1 << 20, 1 * kMiB, 100, true, true, Alignment{}, 1, 256 * kKiB);
    CHECK_EQ(p.slices.size(), size_t(1));
    CHECK(p.has_edges);
    CHECK_EQ(p.slices[0].head_end, page - 100);                  // up to the first page boundary in the file
    CHECK_EQ((100 + p.slices[0].body_end) % page, size_t(0));
    CHECK_EQ(p.slices[0].tail_end, 1 * kMiB);
    // The memory under the body starts at mem + head: not page aligned, so the body is staged.
    CHECK(p.staged);
}

TEST(request_within_one_page_is_one_buffered_edge) {
    RequestPlan p = plan_request(1 << 20, 100, 10, true, true, Alignment{}, 8, 256 * kKiB);
    CHECK_EQ(p.slices.size(), size_t(1));
    CHECK_EQ(p.slices[0].head_end, size_t(100));
    CHECK(p.slices[0].body_begin == p.slices[0].body_end);
    CHECK(p.has_edges && !p.staged);
}

TEST(unaligned_or_device_memory_is_staged) {
    CHECK(plan_request((1 << 20) + 512, kMiB, 0, true, true, Alignment{4096, 4096}, 1, kMiB).staged);
    CHECK(!plan_request((1 << 20) + 512, kMiB, 0, true, true, Alignment{512, 4096}, 1, kMiB).staged);
    CHECK(plan_request(1 << 20, kMiB, 0, true, false, Alignment{}, 1, kMiB).staged);   // device memory
    CHECK(plan_request(1 << 20, kMiB, 0, false, false, Alignment{}, 1, kMiB).staged);  // buffered, device
    CHECK(!plan_request(1 << 20, kMiB, 0, false, true, Alignment{}, 1, kMiB).staged);  // buffered, host
}

TEST(min_slice_keeps_small_requests_on_one_thread) {
    RequestPlan p = plan_request(1 << 20, kMiB, 0, true, true, Alignment{}, 8, 4 * kMiB);
    CHECK_EQ(p.slices.size(), size_t(1));
    p = plan_request(1 << 20, kMiB, 0, true, true, Alignment{}, 8, 256 * kKiB);
    CHECK_EQ(p.slices.size(), size_t(4));
}

TEST(device_alignment_above_the_page_sets_the_granule) {
    const size_t big = 4 * dnv::page_size();
    RequestPlan p = plan_request(0, 10 * big + 7, big / 2, true, true, Alignment{big, big}, 3, 1);
    check_invariants(p, 0, 10 * big + 7, big / 2, true, true, Alignment{big, big}, 3, 1);
    CHECK_EQ(p.slices.front().head_end, big / 2);
}

TEST(random_requests_keep_every_rule) {
    std::mt19937_64 rng(20261201);
    const size_t page = dnv::page_size();
    for (int i = 0; i < 20000; ++i) {
        const uintptr_t mem = (rng() % 64) * 512 + (rng() % 4 == 0 ? rng() % 512 : 0);
        const size_t n = rng() % 3 == 0 ? rng() % (3 * page) : rng() % (64 * kMiB);
        const uint64_t off = rng() % 2 == 0 ? (rng() % 1024) * page : rng() % (1ull << 40);
        const bool direct = rng() % 5 != 0, host = rng() % 5 != 0;
        const Alignment a{size_t(512) << (rng() % 5), size_t(512) << (rng() % 6)};
        const unsigned par = static_cast<unsigned>(1 + rng() % 16);
        const size_t min_slice = size_t(1) << (rng() % 26);
        RequestPlan p = plan_request(mem, n, off, direct, host, a, par, min_slice);
        const int before = check::failures();
        check_invariants(p, mem, n, off, direct, host, a, par, min_slice);
        if (check::failures() != before) {
            std::fprintf(stderr, "  inputs: mem=%zu n=%zu off=%llu direct=%d host=%d align={%zu,%zu} par=%u "
                         "min_slice=%zu\n", static_cast<size_t>(mem), n, static_cast<unsigned long long>(off),
                         direct, host, a.mem, a.off, par, min_slice);
            return;
        }
    }
}
