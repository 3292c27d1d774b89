// The engine table, built from engine_list.h: names, constructors and availability probes, in order of
// preference. Nothing here names an engine.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <mutex>

#include "engine.h"
#include "engine_specs.h"
#include "error.h"
#include "file.h"
#include "quiet_thread.h"
#include "tunables.h"

namespace dnv {
namespace {

struct EngineSpec {
    const char* name;
    std::unique_ptr<Engine> (*make)(unsigned, const std::shared_ptr<EngineShared>&);
    std::string (*probe)();
    bool automatic;  // may "auto" pick it? (its probe is then cached for the process)
    std::shared_ptr<EngineShared> (*make_shared)();
};

#define DNV_ENGINE_SPEC(id, name, automatic, shared) {name, make_##id##_engine, probe_##id, automatic, shared},
const EngineSpec kEngines[] = {DNV_ENGINE_LIST(DNV_ENGINE_SPEC)};
#undef DNV_ENGINE_SPEC

const EngineSpec* find(const std::string& name) {
    for (const auto& spec : kEngines)
        if (name == spec.name) return &spec;
    return nullptr;
}

std::string automatic_names() {
    std::string out = "auto";
    for (const auto& spec : kEngines)
        if (spec.automatic) out += std::string(", ") + spec.name;
    return out;
}

// The real engines' probes are fixed for the life of the process: computed once, on first use.
struct ProbeCache {
    std::once_flag once;
    std::vector<std::pair<std::string, std::string>> status;
};

ProbeCache& probe_cache() {
    static ProbeCache cache;
    std::call_once(cache.once, [] {
        for (const auto& spec : kEngines) {
            if (!spec.automatic) continue;
            std::string why = spec.probe();
            cache.status.emplace_back(spec.name, why.empty() ? "ok" : why);
        }
    });
    return cache;
}

}  // namespace

std::string round_trip(std::unique_ptr<Engine> engine) {
    // Read the first bytes of our own executable: a file that always exists and needs no O_DIRECT.
    FileDesc fd(::open("/proc/self/exe", O_RDONLY | O_CLOEXEC));
    if (!fd) return "cannot open /proc/self/exe for the probe: " + errno_text(errno);
    alignas(64) char buf[512];
    // A signal pending on this (the caller's) thread could cancel the read (quiet_thread.h), and an engine
    // that failed its probe stays off for the process.
    SignalsBlocked quiet;
    IoOp op{fd.get(), buf, sizeof(buf), 0, false, 7, -1};
    if (engine->submit(&op, 1) != 1) return "submit accepted nothing";
    IoDone done{};
    if (engine->reap(&done, 1, 1) != 1) return "no completion";
    if (done.tag != 7) return "completion carried the wrong tag";
    if (done.res < 0) return "probe read failed: " + errno_text(static_cast<int>(-done.res));
    if (done.res == 0) return "probe read returned no data";
    return {};
}

std::vector<std::pair<std::string, std::string>> engine_status() {
    auto status = probe_cache().status;
    // Test-only engines depend on the environment of the moment ($DEEPNVME_FAULT), so they are asked anew.
    for (const auto& spec : kEngines) {
        if (spec.automatic) continue;
        std::string why = spec.probe();
        status.emplace_back(spec.name, why.empty() ? "ok" : why);
    }
    return status;
}

std::string not_built_reason(const char* library, const char* package) {
    return std::string("not built in: ") + library + " (" + package + ") was not found when async_io was compiled";
}

std::vector<std::string> available_engines() {
    std::vector<std::string> names;
    for (const auto& [name, why] : probe_cache().status)
        if (why == "ok") names.push_back(name);
    return names;
}

std::string resolve_engine(const std::string& requested) {
    // Every handle starts here: a malformed $DEEPNVME_* tunable fails now, in the caller's thread, rather
    // than later in a worker.
    (void)tunables();
    std::string name = requested;
    if (name.empty() || name == "auto") {
        const char* env = std::getenv("DEEPNVME_ENGINE");
        name = (env != nullptr && *env != '\0') ? env : "auto";
    }
    if (name == "auto") return available_engines().front();  // posix always passes
    if (find(name) == nullptr) throw ArgError("unknown engine '" + name + "' (choose " + automatic_names() + ")");
    for (const auto& [known, why] : engine_status())
        if (known == name && why != "ok") throw UnsupportedError("engine '" + name + "' is unavailable: " + why);
    return name;
}

std::shared_ptr<EngineShared> make_engine_shared(const std::string& name) {
    const EngineSpec* spec = find(name);
    return spec != nullptr && spec->make_shared != nullptr ? spec->make_shared() : nullptr;
}

std::unique_ptr<Engine> make_engine(const std::string& name, unsigned queue_depth,
                                    const std::shared_ptr<EngineShared>& shared) {
    const EngineSpec* spec = find(name);
    if (spec == nullptr) throw UnsupportedError("engine '" + name + "' is not built into this module");
    return spec->make(queue_depth, shared);
}

}  // namespace dnv
