// Every COMMLIB_* environment variable, declared once with its default, category and meaning
// (csrc/common/env.cc holds the table; docs/knobs.md is generated from it by tools/knobs_table.py).
// The core reads the runtime and tuning knobs once, when a communicator resolves its
// configuration (csrc/core/algorithm_selector.hpp); test-only and build knobs are read by the test
// launcher and setup.py and only declared here.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace commlib::env {

// Who a knob is for.
enum class KnobCategory {
  kRuntime,   // behaviour a user may choose (timeouts, workspace sizes, opt-ins)
  kTuning,    // thresholds and grid sizes; the defaults are measured, override to tune a new machine
  kTestOnly,  // read by the tests and their launcher only
  kBuild,     // read when building (setup.py, compile definitions), never at run time
};
const char* category_name(KnobCategory category);

struct Knob {
  const char* name;
  const char* default_value;
  KnobCategory category;
  const char* meaning;
};

// The full table, in docs/knobs.md's order.
const std::vector<Knob>& knobs();

// Value of a declared knob (its default when unset). Throws InvalidArgument for an undeclared
// name, so a typo in the code cannot silently read nothing.
std::string get(const char* name);
int64_t get_int(const char* name);
bool get_bool(const char* name);

}  // namespace commlib::env
