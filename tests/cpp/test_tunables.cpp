// The tunables' parser: what $DEEPNVME_* accepts and how each refusal names the variable.
#include <map>
#include <string>

#include "check.h"
#include "error.h"
#include "tunables.h"

using dnv::ArgError;
using dnv::parse_tunable;

namespace {
constexpr size_t kMax = 68719476736ull;
size_t parse(const char* text, size_t multiple = 1, size_t minimum = 1, size_t maximum = kMax) {
    return parse_tunable("DEEPNVME_X", text, 77, multiple, minimum, maximum);
}
}  // namespace

TEST(unset_or_blank_gives_the_default) {
    CHECK_EQ(parse(nullptr), size_t(77));
    CHECK_EQ(parse(""), size_t(77));
    CHECK_EQ(parse(" \t "), size_t(77));
}

TEST(digits_and_binary_suffixes) {
    CHECK_EQ(parse("4096"), size_t(4096));
    CHECK_EQ(parse(" 64K\t"), size_t(64) << 10);
    CHECK_EQ(parse("64k"), size_t(64) << 10);
    CHECK_EQ(parse("8 M"), size_t(8) << 20);
    CHECK_EQ(parse("2g"), size_t(2) << 30);
    CHECK_EQ(parse("000000000000001"), size_t(1));  // 15 digits
}

TEST(malformed_text_names_the_variable) {
    for (const char* bad : {"x", "-1", "+1", "1.5", "1KB", "K", "1 2", "0x10", "1e3", "١"})
        CHECK_THROWS(parse(bad), ArgError, "DEEPNVME_X='");
    CHECK_THROWS(parse("1T"), ArgError, "positive integer");
    CHECK_THROWS(parse("0000000000000001"), ArgError, "positive integer");  // 16 digits
}

TEST(bounds_and_multiples) {
    CHECK_THROWS(parse("0"), ArgError, "must be at least 1");
    CHECK_THROWS(parse("3", 1, 4), ArgError, "must be at least 4");
    CHECK_THROWS(parse("4097", 4096), ArgError, "must be a multiple of 4096");
    CHECK_EQ(parse("8K", 4096), size_t(8192));
    CHECK_THROWS(parse("65G"), ArgError, "must be at most 68719476736");
    CHECK_EQ(parse("64G"), kMax);
    // 15 digits times G would not fit in 64 bits: refused by the bound, never wrapped into range.
    CHECK_THROWS(parse("999999999999999G"), ArgError, "must be at most");
    CHECK_THROWS(parse("999999999999999G", 1, 1, ~size_t(0)), ArgError, "must be at most");
}

TEST(read_tunables_takes_each_variable_and_checks_the_pool) {
    std::map<std::string, std::string> env;
    auto lookup = [&](const char* name) -> const char* {
        auto it = env.find(name);
        return it == env.end() ? nullptr : it->second.c_str();
    };
    dnv::Tunables t = dnv::read_tunables(lookup);
    CHECK_EQ(t.staging_buffers, size_t(DEEPNVME_DEFAULT_STAGING_BUFFERS));
    CHECK_EQ(t.staging_buffer_bytes, size_t(DEEPNVME_DEFAULT_STAGING_BUFFER_BYTES));
    env["DEEPNVME_STAGING_BUFFERS"] = "4";
    env["DEEPNVME_MIN_SLICE_BYTES"] = "1M";
    t = dnv::read_tunables(lookup);
    CHECK_EQ(t.staging_buffers, size_t(4));
    CHECK_EQ(t.min_slice_bytes, size_t(1) << 20);
    env["DEEPNVME_STAGING_BUFFERS"] = "1";
    CHECK_THROWS(dnv::read_tunables(lookup), ArgError, "DEEPNVME_STAGING_BUFFERS='1' must be at least 2");
    env["DEEPNVME_STAGING_BUFFERS"] = "65536";
    env["DEEPNVME_STAGING_BUFFER_BYTES"] = "2M";
    CHECK_THROWS(dnv::read_tunables(lookup), ArgError, "must be at most 68719476736 bytes");
}
