// fault engine, for tests: runs plain pread/pwrite like the posix engine but injects the failures a disk
// cannot produce on demand (EIO, short transfers, partial or refused submits), by rules from $DEEPNVME_FAULT.
// Rules (comma-separated): eio@N, enospc@N, short@N, zero@N, unaligned_short@N, eagain_submit@N,
// partial_submit, hold@N (several allowed). N counts block operations (or submit calls) from 1, across all
// engines of one handle.
//
// hold@N lets a test decide when a transfer may finish, instead of racing a timer against it.
// $DEEPNVME_FAULT_GATE names a directory: operation N creates the file held.N there (so the test knows it is
// held), then blocks its worker until the test creates go.N; after that it runs as any other operation (other
// rules for N apply). A gate never opened fails the operation with ETIMEDOUT after kHoldLimit, and one that
// cannot be announced with the error of creating held.N, so that a broken test fails instead of hanging.
//
// unaligned_short@N reaches the handle's buffered path for the remainder of a short O_DIRECT transfer, which
// real disks take only rarely (a file shrinking under a read) and short@N cannot: half of an O_DIRECT block
// may itself be an invalid O_DIRECT request. It issues the block exactly as asked (so always a valid
// request), then reports an odd byte count, never a multiple of any device's alignment, and leaves poison
// where the unreported bytes belong (in the buffer after a read, in the file after a write): only a
// remainder transfer to the right place puts the right bytes back.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "engine.h"
#include "engine_specs.h"
#include "error.h"

namespace dnv {
namespace {

struct FaultRules final : EngineShared {
    long eio_at = 0, enospc_at = 0, short_at = 0, zero_at = 0, unaligned_short_at = 0, eagain_submit_at = 0;
    bool partial_submit = false;
    std::vector<long> hold_at;
    std::string gate;  // $DEEPNVME_FAULT_GATE, the directory of hold@N's files
    std::atomic<long> ops{0};
    std::atomic<long> submits{0};
};

long parse_count(const std::string& rule, size_t at) {
    char* end = nullptr;
    long v = std::strtol(rule.c_str() + at + 1, &end, 10);
    if (end == rule.c_str() + at + 1 || *end != '\0' || v <= 0)
        throw ArgError("DEEPNVME_FAULT: bad count in rule '" + rule + "' (want NAME@N with N >= 1)");
    return v;
}

std::shared_ptr<FaultRules> parse_rules(const char* text) {
    auto rules = std::make_shared<FaultRules>();
    std::string all(text);
    size_t start = 0;
    while (start <= all.size()) {
        size_t comma = all.find(',', start);
        std::string rule = all.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
        start = comma == std::string::npos ? all.size() + 1 : comma + 1;
        if (rule.empty()) continue;
        size_t at = rule.find('@');
        std::string name = rule.substr(0, at);
        if (name == "partial_submit" && at == std::string::npos) {
            rules->partial_submit = true;
            continue;
        }
        if (at == std::string::npos) throw ArgError("DEEPNVME_FAULT: rule '" + rule + "' needs @N");
        long n = parse_count(rule, at);
        if (name == "eio") rules->eio_at = n;
        else if (name == "enospc") rules->enospc_at = n;
        else if (name == "short") rules->short_at = n;
        else if (name == "zero") rules->zero_at = n;
        else if (name == "unaligned_short") rules->unaligned_short_at = n;
        else if (name == "eagain_submit") rules->eagain_submit_at = n;
        else if (name == "hold") rules->hold_at.push_back(n);
        else throw ArgError("DEEPNVME_FAULT: unknown rule '" + name + "'");
    }
    if (!rules->hold_at.empty()) {
        const char* gate = std::getenv("DEEPNVME_FAULT_GATE");
        if (gate == nullptr || *gate == '\0')
            throw ArgError("DEEPNVME_FAULT: rule hold@N needs $DEEPNVME_FAULT_GATE, the directory where the "
                           "test releases held operations");
        rules->gate = gate;
    }
    return rules;
}

class FaultEngine final : public InlineEngine {
public:
    FaultEngine(unsigned queue_depth, std::shared_ptr<FaultRules> rules) : rules_(std::move(rules)) {
        done_.reserve(queue_depth);
    }

    bool allows_bypass() const override { return false; }

    size_t submit(const IoOp* ops, size_t n) override {
        long call = ++rules_->submits;
        if (call == rules_->eagain_submit_at) return 0;
        if (rules_->partial_submit && n > 1) n = 1;
        for (size_t i = 0; i < n; ++i) done_.push_back({ops[i].tag, run(ops[i])});
        return n;
    }

private:
    int64_t run(const IoOp& op) {
        long k = ++rules_->ops;
        if (std::find(rules_->hold_at.begin(), rules_->hold_at.end(), k) != rules_->hold_at.end()) {
            int err = hold(k);
            if (err != 0) return -err;
        }
        if (k == rules_->eio_at) return -EIO;
        if (k == rules_->enospc_at) return -ENOSPC;
        if (k == rules_->zero_at) return 0;
        if (k == rules_->short_at && op.len > 1) {
            IoOp half = op;
            half.len = op.len / 2;
            return transfer_once(half);
        }
        if (k == rules_->unaligned_short_at && op.len > 2) return unaligned_short(op);
        return transfer_once(op);
    }

    static constexpr std::chrono::seconds kHoldLimit{60};

    // Announces operation k as held, then waits for its gate: 0 once open, else an errno.
    int hold(long k) const {
        const std::string held = rules_->gate + "/held." + std::to_string(k);
        const std::string go = rules_->gate + "/go." + std::to_string(k);
        int fd = ::open(held.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
        if (fd < 0) return errno;
        ::close(fd);
        // Polled: a test opens the gate by creating a file, from any thread or process, with no handle to share.
        const auto give_up = std::chrono::steady_clock::now() + kHoldLimit;
        while (::access(go.c_str(), F_OK) != 0) {
            if (std::chrono::steady_clock::now() > give_up) return ETIMEDOUT;
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        return 0;
    }

    static constexpr unsigned char kPoison = 0xA5;

    static int64_t unaligned_short(const IoOp& op) {
        // Block lengths under O_DIRECT are multiples of 512, so half of one plus one byte is odd.
        const size_t count = op.len / 2 + 1;
        if (!op.write) {
            int64_t res = transfer_once(op);
            if (res < static_cast<int64_t>(op.len)) return res;  // a real short read or error: report it
            std::memset(static_cast<char*>(op.buf) + count, kPoison, op.len - count);
            return static_cast<int64_t>(count);
        }
        // Write the first count bytes and poison after them, from a page-aligned copy: the same offset and
        // length as the request, so as valid under O_DIRECT as the request itself.
        void* raw = nullptr;
        if (posix_memalign(&raw, 4096, op.len) != 0) return -ENOMEM;
        std::unique_ptr<void, decltype(&std::free)> copy(raw, &std::free);
        std::memcpy(raw, op.buf, count);
        std::memset(static_cast<char*>(raw) + count, kPoison, op.len - count);
        IoOp poisoned = op;
        poisoned.buf = raw;
        int64_t res = transfer_once(poisoned);
        return res < static_cast<int64_t>(op.len) ? res : static_cast<int64_t>(count);
    }

    std::shared_ptr<FaultRules> rules_;
};

}  // namespace

std::shared_ptr<EngineShared> make_fault_shared() {
    const char* text = std::getenv("DEEPNVME_FAULT");
    if (text == nullptr || *text == '\0')
        throw UnsupportedError("engine 'fault' is for tests and needs rules in $DEEPNVME_FAULT (e.g. eio@2)");
    return parse_rules(text);
}

std::unique_ptr<Engine> make_fault_engine(unsigned qd, const std::shared_ptr<EngineShared>& shared) {
    auto rules = std::dynamic_pointer_cast<FaultRules>(shared);
    if (!rules) throw UnsupportedError("engine 'fault' was created without its rules");
    return std::make_unique<FaultEngine>(qd, std::move(rules));
}

std::string probe_fault() {
    const char* text = std::getenv("DEEPNVME_FAULT");
    return text != nullptr && *text != '\0' ? std::string() : std::string("test-only: set $DEEPNVME_FAULT to use it");
}

}  // namespace dnv
