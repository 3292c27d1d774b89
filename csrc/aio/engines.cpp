// The engine table: names, constructors and availability probes, in order of preference.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <mutex>

#include "engine.h"
#include "engine_specs.h"
#include "error.h"
#include "file.h"

namespace dnv {
namespace {

struct EngineSpec {
    const char* name;
    std::unique_ptr<Engine> (*make)(unsigned, const std::shared_ptr<EngineShared>&);
    std::string (*probe)();
    bool automatic;  // may "auto" pick it?
};

const EngineSpec kEngines[] = {
#if DEEPNVME_WITH_URING
    {"io_uring", make_uring_engine, probe_uring, true},
#endif
#if DEEPNVME_WITH_LIBAIO
    {"libaio", make_libaio_engine, probe_libaio, true},
#endif
    {"posix", make_posix_engine, probe_posix, true},
    {"fault", make_fault_engine, probe_fault, false},
};

const char* not_built_reason(const std::string& name) {
    if (name == "io_uring") return "not built in: liburing (liburing-dev) was not found when async_io was compiled";
    if (name == "libaio") return "not built in: libaio (libaio-dev) was not found when async_io was compiled";
    return nullptr;
}

const EngineSpec* find(const std::string& name) {
    for (const auto& spec : kEngines)
        if (name == spec.name) return &spec;
    return nullptr;
}

// Probe results are fixed for the life of the process; computed once, on first use.
struct ProbeCache {
    std::once_flag once;
    std::vector<std::pair<std::string, std::string>> status;
};

ProbeCache& probe_cache() {
    static ProbeCache cache;
    std::call_once(cache.once, [] {
        for (const char* name : {"io_uring", "libaio", "posix"}) {
            const EngineSpec* spec = find(name);
            std::string why = spec ? spec->probe() : std::string(not_built_reason(name));
            cache.status.emplace_back(name, why.empty() ? "ok" : why);
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
    status.emplace_back("fault", probe_fault().empty() ? "ok" : probe_fault());
    return status;
}

std::vector<std::string> available_engines() {
    std::vector<std::string> names;
    for (const auto& [name, why] : probe_cache().status)
        if (why == "ok") names.push_back(name);
    return names;
}

std::string resolve_engine(const std::string& requested) {
    std::string name = requested;
    if (name.empty() || name == "auto") {
        const char* env = std::getenv("DEEPNVME_ENGINE");
        name = (env != nullptr && *env != '\0') ? env : "auto";
    }
    if (name == "auto") return available_engines().front();  // posix always passes
    const EngineSpec* spec = find(name);
    if (spec == nullptr && not_built_reason(name) == nullptr)
        throw ArgError("unknown engine '" + name + "' (choose auto, io_uring, libaio, posix)");
    for (const auto& [known, why] : engine_status())
        if (known == name && why != "ok") throw UnsupportedError("engine '" + name + "' is unavailable: " + why);
    return name;
}

std::shared_ptr<EngineShared> make_engine_shared(const std::string& name) {
    if (name == "fault") return make_fault_shared();
    return nullptr;
}

std::unique_ptr<Engine> make_engine(const std::string& name, unsigned queue_depth,
                                    const std::shared_ptr<EngineShared>& shared) {
    const EngineSpec* spec = find(name);
    if (spec == nullptr) throw UnsupportedError("engine '" + name + "' is not built into this module");
    return spec->make(queue_depth, shared);
}

}  // namespace dnv
