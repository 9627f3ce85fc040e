// Every COMMLIB_* environment variable, declared once with its default and meaning
// (csrc/core/env.cc holds the table; README.md lists it). Read at use, so tests may change them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace commlib::env {

struct Knob {
  const char* name;
  const char* default_value;
  const char* meaning;
};

// The full table, in README order.
const std::vector<Knob>& knobs();

// Value of a declared knob (its default when unset). Throws InvalidArgument for an undeclared
// name, so a typo in the code cannot silently read nothing.
std::string get(const char* name);
int64_t get_int(const char* name);
bool get_bool(const char* name);

}  // namespace commlib::env
