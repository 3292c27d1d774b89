// The staging share: how much of the pool one holder may take, and how a staged operation is cut to fit.
#include "check.h"
#include "staging_share.h"

using dnv::staging_share;

namespace {
constexpr size_t kMiB = 1024 * 1024;
}

TEST(share_is_half_the_pool_and_bounded_by_the_worker_bytes) {
    auto s = staging_share(kMiB, 128, 64 * kMiB);
    CHECK_EQ(s.max_buffers, size_t(64));
    CHECK_EQ(s.max_op_bytes(), 64 * kMiB);
    s = staging_share(kMiB, 128, 8 * kMiB);
    CHECK_EQ(s.max_op_bytes(), 8 * kMiB);
    s = staging_share(kMiB, 16, 64 * kMiB);
    CHECK_EQ(s.max_op_bytes(), 8 * kMiB);
}

TEST(a_pool_of_one_or_two_still_gives_one_buffer) {
    CHECK_EQ(staging_share(kMiB, 1, kMiB).max_buffers, size_t(1));
    CHECK_EQ(staging_share(kMiB, 2, kMiB).max_buffers, size_t(1));
    CHECK_EQ(staging_share(kMiB, 3, kMiB).max_buffers, size_t(1));
}

TEST(worker_bytes_below_one_buffer_still_allow_one_buffer) {
    auto s = staging_share(kMiB, 128, 4096);
    CHECK_EQ(s.max_op_bytes(), kMiB);
}

TEST(buffers_for_rounds_up) {
    auto s = staging_share(kMiB, 128, 64 * kMiB);
    CHECK_EQ(s.buffers_for(0), size_t(0));
    CHECK_EQ(s.buffers_for(1), size_t(1));
    CHECK_EQ(s.buffers_for(kMiB), size_t(1));
    CHECK_EQ(s.buffers_for(kMiB + 1), size_t(2));
}

TEST(op_length_cuts_in_whole_units_and_never_exceeds_the_share) {
    auto s = staging_share(kMiB, 8, 64 * kMiB);  // 4 buffers: 4 MiB
    CHECK_EQ(s.op_length(kMiB, 4096), kMiB);
    CHECK_EQ(s.op_length(100 * kMiB, 4096), 4 * kMiB);
    CHECK_EQ(s.op_length(100 * kMiB, 3 * kMiB), 3 * kMiB);  // whole units only
    CHECK_EQ(s.op_length(100 * kMiB, 5 * kMiB), size_t(0));  // one unit does not fit: refused
    CHECK_EQ(s.op_length(12345, 1), size_t(12345));
    for (size_t len = 1; len < 20 * kMiB; len = len * 3 + 1)
        for (size_t unit : {size_t(1), size_t(512), size_t(4096)}) {
            size_t got = s.op_length(len, unit);
            CHECK(got <= s.max_op_bytes());
            CHECK(s.buffers_for(got) <= s.max_buffers);
            if (len > s.max_op_bytes()) CHECK(got % unit == 0 && got > 0);
        }
}

TEST(admits_a_first_run_always_and_later_ones_within_both_bounds) {
    auto s = staging_share(kMiB, 8, 3 * kMiB);  // 4 buffers, 3 MiB in flight
    CHECK(s.admits(0, 0, 4, 4 * kMiB));        // holding nothing: never wait on itself
    CHECK(s.admits(1, kMiB, 2, 2 * kMiB));
    CHECK(!s.admits(1, kMiB, 4, kMiB));        // too many buffers
    CHECK(!s.admits(1, 2 * kMiB, 1, 2 * kMiB));  // too many bytes in flight
    CHECK(s.admits(3, 2 * kMiB, 1, kMiB));
}
