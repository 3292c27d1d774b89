// The continuation rule for a transfer that moved fewer bytes than asked.
#include "check.h"
#include "continuation.h"

using dnv::Alignment;
using dnv::Continuation;
using dnv::continuation;

TEST(complete_and_empty_transfers) {
    const Alignment a{4096, 4096};
    CHECK(continuation(8192, 8192, 0, 0, true, a) == Continuation::kDone);
    CHECK(continuation(0, 8192, 0, 0, true, a) == Continuation::kNoProgress);
    CHECK(continuation(0, 8192, 0, 0, false, a) == Continuation::kNoProgress);
}

TEST(a_buffered_rest_continues_as_it_is) {
    CHECK(continuation(100, 8192, 3, 7, false, Alignment{4096, 4096}) == Continuation::kSameDescriptor);
}

TEST(a_direct_rest_stays_direct_only_while_aligned) {
    const Alignment a{4096, 512};
    CHECK(continuation(4096, 8192, 0, 0, true, a) == Continuation::kSameDescriptor);
    CHECK(continuation(512, 8192, 0, 4096, true, a) == Continuation::kBuffered);    // memory lost alignment
    CHECK(continuation(512, 8192, 0, 3584, true, a) == Continuation::kSameDescriptor);  // memory regains it
    CHECK(continuation(100, 8192, 0, 0, true, a) == Continuation::kBuffered);       // offset lost it
    CHECK(continuation(4096, 8192 + 100, 0, 0, true, a) == Continuation::kBuffered);  // length is not whole
    CHECK(continuation(1024, 8192, 512, 0, true, Alignment{0, 0}) == Continuation::kSameDescriptor);
}
