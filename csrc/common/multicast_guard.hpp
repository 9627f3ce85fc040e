// The one gate in front of every NVLink multicast (NVLS / multimem) path (docs/architecture.md, Safety).
//
// A multicast path runs only when COMMLIB_ENABLE_MULTICAST set to 1 is set AND none of the kill switches
// is set: COMMLIB_DISABLE_MULTICAST=1, NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
// NVSHMEM_DISABLE_NVLS=1 (for the last three, any value other than the one that enables
// multicast counts as set). Decided from the environment only: no CUDA driver or runtime call is
// made before the answer is "allowed". Kill switches are checked first, so the refusal names the
// kill switch even when the opt-in is missing too.
#pragma once

#include <functional>
#include <optional>
#include <string>

namespace commlib {

struct MulticastDecision {
  bool allowed = false;
  std::string variable;  // the variable that decided a refusal (empty when allowed)
  std::string reason;    // a sentence naming the variable and its value
};

// Looks a variable up: nullopt when unset. The default reads the process environment.
using EnvLookup = std::function<std::optional<std::string>(const char* name)>;

MulticastDecision multicast_decision();
MulticastDecision multicast_decision(const EnvLookup& lookup);

// Throws InvalidArgument "<what>: NVLink multicast refused: ..." unless allowed.
void require_multicast(const char* what);

}  // namespace commlib
