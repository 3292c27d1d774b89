#include "pipeline.h"

#include <pthread.h>

#include <algorithm>
#include <cerrno>
#include <iterator>
#include <set>

#include "error.h"

namespace dnv {
namespace {

// Forks this process has made; a pipeline made before the latest one belongs to an ancestor.
std::atomic<unsigned> g_forks{0};

unsigned fork_generation() {
    static std::once_flag once;
    std::call_once(once, [] { ::pthread_atfork(nullptr, nullptr, [] { g_forks.fetch_add(1); }); });
    return g_forks.load();
}

}  // namespace

void PendingRequest::open_target(const std::string& path, int fd, bool own_dup) {
    file = fd >= 0 ? TargetFile::from_fd(fd, write, !own_dup) : TargetFile::open_path(path, write);
    if (write || nbytes == 0) return;
    uint64_t size = file.size();
    if (offset + nbytes > size)
        throw ArgError("read past end of file " + file.path() + ": file_offset " + std::to_string(offset) +
                       " + buffer nbytes " + std::to_string(nbytes) + " > file size " + std::to_string(size));
}

void PendingRequest::fail(int err, const std::string& what) {
    std::lock_guard<std::mutex> lock(err_mu_);
    if (failed_.load(std::memory_order_relaxed)) return;
    err_ = err;
    err_what_ = what;
    failed_.store(true, std::memory_order_release);
}

Pipeline::Pipeline(std::string owner) : owner_(std::move(owner)), fork_generation_(fork_generation()) {}

bool Pipeline::inherited() const noexcept { return g_forks.load() != fork_generation_; }

void Pipeline::refuse_if_inherited() const {
    if (inherited())
        throw UnsupportedError("this " + owner_ +
                               " was made before fork() and its worker threads stayed in the parent: make a new "
                               "handle in the child process");
}

void Pipeline::abandon(std::vector<std::shared_ptr<void>>* holds) {
    // Only a thread of the parent can hold the lock here (a worker completing a request as the fork came):
    // that thread does not exist in this process, so waiting for it would hang. Nothing of this process
    // takes the lock of an inherited pipeline besides this call.
    std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
    for (auto& r : pending_) {
        if (holds != nullptr) holds->push_back(std::move(r->keepalive));
        new std::shared_ptr<PendingRequest>(std::move(r));
    }
    pending_.clear();
}

uint64_t Pipeline::add(std::shared_ptr<PendingRequest> r, bool finished) {
    std::lock_guard<std::mutex> lock(mu_);
    uint64_t id = r->id = ++next_id_;
    if (finished) r->done = true;
    pending_.push_back(std::move(r));
    return id;
}

void Pipeline::complete(PendingRequest* r) {
    {
        std::lock_guard<std::mutex> lock(mu_);
        r->done = true;
    }
    cv_.notify_all();
}

size_t Pipeline::wait(uint64_t own, Handed& out, const std::function<bool()>& interrupted) {
    refuse_if_inherited();
    // Declared before the lock, so destroyed after it is released: another thread's wait() may have handed
    // these requests over already, leaving them their last references, and a request's destruction releases
    // tensors whose deleters may take the GIL. Nothing may be freed while mu_ is held.
    Handed covered, not_ours;
    std::unique_lock<std::mutex> lock(mu_);
    for (const auto& r : pending_)
        if (r->completion == Completion::kWait || r->id == own) covered.push_back(r);
    auto all_done = [](const Handed& rs) {
        return std::all_of(rs.begin(), rs.end(), [](const auto& r) { return r->done; });
    };
    // Returns how many of `rs` no other call had handed over: a concurrent call covering the same request
    // gets it too (for its error), but each request is counted by one call only.
    auto hand_over = [&](const Handed& rs) {
        size_t first = 0;
        for (const auto& r : rs) {
            first += r->reported ? 0 : 1;
            r->reported = true;
        }
        pending_.erase(std::remove_if(pending_.begin(), pending_.end(), [](const auto& r) { return r->reported; }),
                       pending_.end());
        out.insert(out.end(), rs.begin(), rs.end());
        return first;
    };
    if (interrupted) {
        while (!cv_.wait_for(lock, kPollInterval, [&] { return all_done(covered); })) {
            lock.unlock();
            bool stop = interrupted();
            lock.lock();
            if (!stop) continue;
            Handed cancel;
            for (const auto& r : covered)
                if (own == 0 || r->id == own) cancel.push_back(r);
            // Workers stop issuing a failed request's work; what is in flight finishes normally. Requests
            // already complete keep their result (a concurrent wait() covering them may report it).
            for (const auto& r : cancel)
                if (!r->done) r->fail(ECANCELED, "cancelled by an interruption (KeyboardInterrupt)");
            cv_.wait(lock, [&] { return all_done(cancel); });
            hand_over(cancel);
            // The others stay pending, yet another thread's wait() may have reported them meanwhile, leaving
            // `covered` their last reference: the caller drops everything in `out` with the GIL held.
            out.insert(out.end(), std::make_move_iterator(covered.begin()), std::make_move_iterator(covered.end()));
            throw Interrupted{};
        }
    } else {
        cv_.wait(lock, [&] { return all_done(covered); });
    }
    if (own != 0) {
        // A sync call reports only its own error: failed or unvalidated async requests wait for a wait().
        auto theirs = std::stable_partition(covered.begin(), covered.end(), [own](const auto& r) {
            return !(r->id != own && (r->failed() || r->validate));
        });
        not_ours.assign(std::make_move_iterator(theirs), std::make_move_iterator(covered.end()));
        covered.erase(theirs, covered.end());
    }
    return hand_over(covered);
}

Handed::iterator Pipeline::find_pending(uint64_t id) {
    return std::lower_bound(pending_.begin(), pending_.end(), id,
                            [](const auto& r, uint64_t want) { return r->id < want; });
}

const std::shared_ptr<PendingRequest>& Pipeline::own_request(uint64_t id) {
    auto it = find_pending(id);
    if (it == pending_.end() || (*it)->id != id || (*it)->completion != Completion::kOwn)
        throw ArgError("request " + std::to_string(id) + " is not pending on this " + owner_ +
                       ": unknown, already handed over by wait_request(), or not made by submit_pread/submit_pwrite");
    return *it;
}

void Pipeline::wait_request(uint64_t id, Handed& out, const std::function<bool()>& interrupted) {
    refuse_if_inherited();
    std::unique_lock<std::mutex> lock(mu_);
    // Into `out` at once: never released here, where mu_ is held or the GIL is not.
    out.push_back(own_request(id));
    PendingRequest* const r = out.back().get();
    auto done = [r] { return r->done; };
    if (interrupted) {
        while (!cv_.wait_for(lock, kPollInterval, done)) {
            lock.unlock();
            bool stop = interrupted();
            lock.lock();
            if (stop) throw Interrupted{};  // left running and pending: nothing is cancelled
        }
    } else {
        cv_.wait(lock, done);
    }
    // Another thread's wait_request() for the same id may have got there first: it is that call's.
    if (r->reported)
        throw ArgError("request " + std::to_string(id) + " was handed over by another wait_request() meanwhile");
    r->reported = true;
    pending_.erase(find_pending(id));  // still there: only this call hands it over
}

bool Pipeline::request_done(uint64_t id) {
    refuse_if_inherited();
    std::lock_guard<std::mutex> lock(mu_);
    return own_request(id)->done;
}

std::vector<uint64_t> Pipeline::wait_completed(std::chrono::milliseconds timeout,
                                               const std::function<bool()>& interrupted) {
    refuse_if_inherited();
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    auto next_poll = std::chrono::steady_clock::now() + kPollInterval;
    std::vector<uint64_t> ids;
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
        for (const auto& r : pending_) {
            if (r->completion != Completion::kOwn || !r->done || r->announced || r->reported) continue;
            r->announced = true;
            ids.push_back(r->id);
        }
        if (!ids.empty()) return ids;
        const auto now = std::chrono::steady_clock::now();
        if (timeout.count() >= 0 && now >= deadline) return ids;
        // Woken by every completion (others' included), so signals are polled by the clock, not per wake-up.
        auto until = interrupted ? next_poll : now + std::chrono::hours(1);
        if (timeout.count() >= 0) until = std::min(until, deadline);
        cv_.wait_until(lock, until);
        if (!interrupted || std::chrono::steady_clock::now() < next_poll) continue;
        next_poll = std::chrono::steady_clock::now() + kPollInterval;
        lock.unlock();
        bool stop = interrupted();
        lock.lock();
        if (stop) throw Interrupted{};
    }
}

void Pipeline::drain(Handed& out) {
    if (inherited()) return;  // the destructor keeps them: no thread of this process works on them
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return std::all_of(pending_.begin(), pending_.end(), [](const auto& r) { return r->done; }); });
    for (auto& r : pending_) {
        r->reported = true;
        out.push_back(std::move(r));
    }
    pending_.clear();
}

const PendingRequest* first_failure(const Handed& reqs) {
    const PendingRequest* best = nullptr;
    for (const auto& r : reqs)
        if (r->failed() && (best == nullptr || r->id < best->id)) best = r.get();
    return best;
}

bool first_notice(const std::string& cause) {
    static std::mutex mu;
    static std::set<std::string> seen;
    std::lock_guard<std::mutex> lock(mu);
    return seen.insert(cause).second;
}

}  // namespace dnv
