#include "common/multicast_guard.hpp"

#include <cstdlib>

#include "commlib/env.hpp"
#include "commlib/errors.hpp"

namespace commlib {
namespace {

struct KillSwitch {
  const char* name;
  const char* enabling_value;  // the one value that does NOT refuse ("0": unset-like, "1": enables)
};

// Checked in this order; the first one set refuses.
constexpr KillSwitch kKillSwitches[] = {
    {"COMMLIB_DISABLE_MULTICAST", "0"},
    {"NCCL_NVLS_ENABLE", "1"},
    {"TORCH_SYMM_MEM_DISABLE_MULTICAST", "0"},
    {"NVSHMEM_DISABLE_NVLS", "0"},
};

}  // namespace

MulticastDecision multicast_decision(const EnvLookup& lookup) {
  for (const KillSwitch& k : kKillSwitches) {
    const std::optional<std::string> value = lookup(k.name);
    if (value.has_value() && !value->empty() && *value != k.enabling_value) {
      return {false, k.name,
              detail::concat(k.name, "=", *value, " is set (a multicast kill switch); unset it only on a machine "
                                                  "where NVLink multicast is known to be safe")};
    }
  }
  const std::optional<std::string> opt_in = lookup("COMMLIB_ENABLE_MULTICAST");
  if (!opt_in.has_value() || *opt_in != "1") {
    return {false, "COMMLIB_ENABLE_MULTICAST",
            detail::concat("COMMLIB_ENABLE_MULTICAST=", opt_in.value_or("<unset>"),
                           "; multicast needs the explicit opt-in COMMLIB_ENABLE_MULTICAST set to 1")};
  }
  return {true, "", ""};
}

MulticastDecision multicast_decision() {
  env::get("COMMLIB_ENABLE_MULTICAST");  // both COMMLIB_ knobs are declared in env.cc
  env::get("COMMLIB_DISABLE_MULTICAST");
  return multicast_decision([](const char* name) -> std::optional<std::string> {
    const char* v = std::getenv(name);
    if (v == nullptr) return std::nullopt;
    return std::string(v);
  });
}

void require_multicast(const char* what) {
  const MulticastDecision d = multicast_decision();
  COMMLIB_CHECK(d.allowed, InvalidArgument, what, ": NVLink multicast refused: ", d.reason);
}

}  // namespace commlib
