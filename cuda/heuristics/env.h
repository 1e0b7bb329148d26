// The one reader of the GROUPMM_SM90_* overrides, which force a choice of
// cuda/heuristics/choose.cc for kernel tuning and its tests. Development builds only
// (GROUPMM_DEV_KNOBS=1 at build time, build/main.rs): a product build never reads the
// environment, and every choice is the rule's. Host only.
#pragma once
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>

namespace gmm {

template <class T>
struct EnvName {
  const char* name;
  T value;
};

// The value of environment variable `var` among `names`; nullopt when it is unset, empty or
// "auto", and always in a product build. A value not among the names prints one warning
// that lists them and counts as "auto". Callers keep the answer in a function-local static:
// read once per process.
template <class T, size_t N>
std::optional<T> env_choice(const char* var, const EnvName<T> (&names)[N]) {
#if !defined(GROUPMM_DEV_KNOBS)
  (void)var;
  (void)names;
  return std::nullopt;
#else
  const char* v = std::getenv(var);
  if (v == nullptr || *v == 0 || std::strcmp(v, "auto") == 0) return std::nullopt;
  for (const EnvName<T>& n : names) {
    if (std::strcmp(v, n.name) == 0) return n.value;
  }
  std::string accepted = "auto";
  for (const EnvName<T>& n : names) accepted += std::string(", ") + n.name;
  std::fprintf(stderr, "groupmm: %s=%s not understood (%s); using auto\n", var, v,
               accepted.c_str());
  return std::nullopt;
#endif
}

}  // namespace gmm
