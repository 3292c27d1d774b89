// The request pipeline's completion per request (pipeline.h): which call hands a request over, exactly once,
// and whose error it carries; driven by hand (add, complete, fail) without an engine, so every interleaving
// here is chosen, not raced.
#include <atomic>
#include <chrono>
#include <cerrno>
#include <memory>
#include <stdexcept>
#include <thread>
#include <vector>

#include "check.h"
#include "error.h"
#include "pipeline.h"

using dnv::ArgError;
using dnv::Completion;
using dnv::Handed;
using dnv::Pipeline;

namespace {

struct FakeRequest final : dnv::PendingRequest {
    std::string verify() override { return {}; }
};

// A request of `kind` made pending in `p`; returns it (the test keeps a reference, as a binding's call does).
std::shared_ptr<FakeRequest> add(Pipeline& p, Completion kind, size_t nbytes = 16) {
    auto r = std::make_shared<FakeRequest>();
    r->completion = kind;
    r->nbytes = nbytes;
    p.add(r, false);
    return r;
}

bool holds(const Handed& out, const dnv::PendingRequest* r) {
    for (const auto& x : out)
        if (x.get() == r) return true;
    return false;
}

}  // namespace

TEST(wait_never_covers_a_request_of_its_own) {
    Pipeline p("test handle");
    auto async = add(p, Completion::kWait);
    auto own = add(p, Completion::kOwn);
    p.complete(async.get());
    Handed out;
    CHECK_EQ(p.wait(0, out), size_t(1));  // returns although `own` has not completed
    CHECK(holds(out, async.get()));
    CHECK(!holds(out, own.get()));
    CHECK(!p.request_done(own->id));
    p.complete(own.get());
    CHECK(p.request_done(own->id));
    Handed mine;
    p.wait_request(own->id, mine);
    CHECK_EQ(mine.size(), size_t(1));
    CHECK(mine.front().get() == own.get());
}

TEST(requests_complete_in_any_order_each_on_its_own) {
    Pipeline p("test handle");
    auto first = add(p, Completion::kOwn);
    auto second = add(p, Completion::kOwn);
    auto third = add(p, Completion::kOwn);
    p.complete(third.get());  // the last submitted finishes first: waiting for it does not wait for the others
    Handed out;
    p.wait_request(third->id, out);
    CHECK(!p.request_done(first->id));
    CHECK(!p.request_done(second->id));
    p.complete(first.get());
    p.complete(second.get());
    p.wait_request(second->id, out);
    p.wait_request(first->id, out);
    CHECK_EQ(out.size(), size_t(3));
}

TEST(a_failure_is_reported_by_its_own_request_only) {
    Pipeline p("test handle");
    auto bad = add(p, Completion::kOwn);
    auto async = add(p, Completion::kWait);
    auto sync = add(p, Completion::kCall);
    bad->fail(EIO, "injected");
    p.complete(bad.get());
    p.complete(async.get());
    p.complete(sync.get());
    Handed by_call;
    CHECK_EQ(p.wait(sync->id, by_call), size_t(2));  // its own and the clean async one
    CHECK(!holds(by_call, bad.get()));
    CHECK(dnv::first_failure(by_call) == nullptr);
    Handed by_wait;
    CHECK_EQ(p.wait(0, by_wait), size_t(0));
    CHECK(by_wait.empty());
    Handed mine;
    p.wait_request(bad->id, mine);
    CHECK(dnv::first_failure(mine) == bad.get());
    CHECK_EQ(bad->error(), EIO);
}

TEST(an_id_is_handed_over_once_and_others_are_refused) {
    Pipeline p("test handle");
    auto own = add(p, Completion::kOwn);
    auto async = add(p, Completion::kWait);
    auto sync = add(p, Completion::kCall);
    p.complete(own.get());
    Handed out;
    p.wait_request(own->id, out);
    CHECK_THROWS(p.wait_request(own->id, out), ArgError, "request 1 is not pending on this test handle");
    CHECK_THROWS(p.request_done(own->id), ArgError, "request 1");
    CHECK_THROWS(p.wait_request(async->id, out), ArgError, "request 2");  // wait()'s, not wait_request()'s
    CHECK_THROWS(p.request_done(sync->id), ArgError, "request 3");
    CHECK_THROWS(p.wait_request(99, out), ArgError, "request 99");
    p.complete(async.get());
    p.complete(sync.get());
    Handed rest;
    p.drain(rest);
}

TEST(an_interrupted_wait_leaves_the_request_pending) {
    Pipeline p("test handle");
    auto own = add(p, Completion::kOwn, 4096);
    Handed out;
    bool thrown = false;
    try {
        p.wait_request(own->id, out, [] { return true; });
    } catch (const Pipeline::Interrupted&) {
        thrown = true;
    }
    CHECK(thrown);
    CHECK_EQ(out.size(), size_t(1));  // a reference for the caller to release
    CHECK(!own->failed());            // not cancelled
    CHECK(!p.request_done(own->id));  // still pending under its id
    p.complete(own.get());
    Handed again;
    p.wait_request(own->id, again, [] { return false; });
    CHECK_EQ(again.size(), size_t(1));
}

TEST(two_waiters_for_one_id_one_gets_it) {
    Pipeline p("test handle");
    auto own = add(p, Completion::kOwn);
    std::atomic<int> got{0}, refused{0};
    auto waiter = [&] {
        Handed out;
        try {
            p.wait_request(own->id, out);
            ++got;
        } catch (const ArgError&) {
            ++refused;
        }
    };
    std::thread a(waiter), b(waiter);
    p.complete(own.get());
    a.join();
    b.join();
    CHECK_EQ(got.load(), 1);
    CHECK_EQ(refused.load(), 1);
}

TEST(drain_hands_over_requests_never_waited_for) {
    Pipeline p("test handle");
    auto own = add(p, Completion::kOwn);
    auto async = add(p, Completion::kWait);
    std::thread finisher([&] {
        p.complete(own.get());
        p.complete(async.get());
    });
    Handed rest;
    p.drain(rest);
    finisher.join();
    CHECK_EQ(rest.size(), size_t(2));
    CHECK(own->reported);
}

TEST(wait_completed_names_each_finished_request_once) {
    using std::chrono::milliseconds;
    Pipeline p("test handle");
    auto first = add(p, Completion::kOwn);
    auto second = add(p, Completion::kOwn);
    auto async = add(p, Completion::kWait);
    auto third = add(p, Completion::kOwn);
    p.complete(async.get());  // not a request of its own: never named
    CHECK(p.wait_completed(milliseconds(0)).empty());
    p.complete(second.get());
    std::vector<uint64_t> ids = p.wait_completed(milliseconds(-1));
    CHECK_EQ(ids.size(), size_t(1));
    CHECK_EQ(ids.front(), second->id);
    CHECK(p.wait_completed(milliseconds(1)).empty());  // named once
    p.complete(third.get());
    Handed out;
    p.wait_request(third->id, out);  // handed over before anyone asked: never named
    std::thread finisher([&] { p.complete(first.get()); });
    ids = p.wait_completed(milliseconds(-1));  // waits for it
    finisher.join();
    CHECK_EQ(ids.size(), size_t(1));
    CHECK_EQ(ids.front(), first->id);
    p.wait_request(first->id, out);
    p.wait_request(second->id, out);  // named, still to be handed over
    CHECK_EQ(out.size(), size_t(3));
    Handed rest;
    p.wait(0, rest);
}

TEST(wait_completed_times_out_and_can_be_interrupted) {
    using std::chrono::milliseconds;
    Pipeline p("test handle");
    CHECK(p.wait_completed(milliseconds(20)).empty());  // nothing pending: waits the timeout, then none
    auto own = add(p, Completion::kOwn);
    bool thrown = false;
    try {
        (void)p.wait_completed(milliseconds(-1), [] { return true; });
    } catch (const Pipeline::Interrupted&) {
        thrown = true;
    }
    CHECK(thrown);
    p.complete(own.get());
    CHECK_EQ(p.wait_completed(milliseconds(-1), [] { return false; }).size(), size_t(1));
    Handed out;
    p.wait_request(own->id, out);
}
