// Launcher arguments as named fields, for the kernel folders' bindings (host only, pybind11):
//   - bind_args binds a plain struct as a Python class whose constructor takes every field by keyword
//     only (an `optional` field defaults to 0) and whose fields read back, read-only;
//   - ArgCheck checks a struct's fields before its launch: a failure throws std::invalid_argument
//     (ValueError in Python) with a message that names the launcher and the field, e.g.
//     "IntranodeContext.dispatch: out_x is null" or "...: num_tokens = 9000 exceeds max_tokens = 8192".
// A pointer may be 0 where its tensor has no elements (torch gives an empty CUDA tensor address 0), so
// a check asks for a pointer only when the call's sizes say the launch reads or writes through it.
// Checks build no string unless they fail (they run before every launch).
#pragma once
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace moe_ep {

class ArgCheck {
 public:
  explicit ArgCheck(const char* where) : where_(where) {}

  [[noreturn]] void fail(const std::string& what) const {
    throw std::invalid_argument(std::string(where_) + ": " + what);
  }

  // A pointer the launch uses (`needed`) must not be 0.
  void pointer(const char* name, uintptr_t value, bool needed = true) const {
    if (needed && value == 0) fail(std::string(name) + " is null");
  }

  void at_least(const char* name, long long value, long long lo) const {
    if (value >= lo) return;
    fail(std::string(name) + " = " + std::to_string(value) +
         (lo == 0 ? std::string(" is negative") : ", expected at least " + std::to_string(lo)));
  }

  // 0 <= value <= bound, the bound named `bound_name`.
  void count(const char* name, long long value, const char* bound_name, long long bound) const {
    at_least(name, value, 0);
    if (value > bound)
      fail(std::string(name) + " = " + std::to_string(value) + " exceeds " + bound_name + " = " +
           std::to_string(bound));
  }

  // value >= 1 and a multiple of `step` (named `step_name`, when given).
  void positive_multiple(const char* name, long long value, long long step, const char* step_name = nullptr) const {
    if (value >= 1 && value % step == 0) return;
    fail(std::string(name) + " = " + std::to_string(value) + ", expected a positive multiple of " +
         (step_name != nullptr ? std::string(step_name) + " = " : std::string()) + std::to_string(step));
  }

  // lo <= value <= hi.
  void in_range(const char* name, long long value, long long lo, long long hi) const {
    if (value < lo || value > hi)
      fail(std::string(name) + " = " + std::to_string(value) + ", expected " + std::to_string(lo) + ".." +
           std::to_string(hi));
  }

 private:
  const char* where_;  // the launcher, e.g. "IntranodeContext.dispatch"
};

namespace named_args {

namespace py = pybind11;

// A field the Python constructor requires.
template <class S, class M>
struct Required {
  using type = M;
  const char* name;
  M S::*member;
  py::arg arg() const { return py::arg(name); }
};

// A field the Python constructor may leave out: it is then 0 (an absent tensor, a pointer the kernel
// accepts as 0).
template <class S, class M>
struct Optional {
  using type = M;
  const char* name;
  M S::*member;
  py::arg_v arg() const { return py::arg(name) = M{}; }
};

template <class S, class M>
Required<S, M> required(const char* name, M S::*member) {
  return {name, member};
}

template <class S, class M>
Optional<S, M> optional(const char* name, M S::*member) {
  return {name, member};
}

// Binds S as `name`: S(*, field=..., ...) setting every listed field (the others stay 0), read-only
// attributes of the same names, and a repr listing them. Returns the class for more methods.
template <class S, class... F>
py::class_<S> bind_args(py::module_& m, const char* name, const char* doc, F... fields) {
  py::class_<S> cls(m, name, doc);
  cls.def(py::init([fields...](typename F::type... values) {
            S s{};
            ((s.*(fields.member) = values), ...);
            return s;
          }),
          py::kw_only(), fields.arg()...);
  (cls.def_readonly(fields.name, fields.member), ...);
  cls.def("__repr__", [name, fields...](const S& s) {
    std::string out = std::string(name) + "(";
    const char* sep = "";
    const auto add = [&](const char* field, const auto& value) {
      out += sep + std::string(field) + "=" + std::string(py::repr(py::cast(value)));
      sep = ", ";
    };
    (add(fields.name, s.*(fields.member)), ...);
    return out + ")";
  });
  return cls;
}

// S.check(dims): what the launcher checks before its launch, callable without a GPU.
template <class D, class S>
py::class_<S>& def_check(py::class_<S>& cls, void (*check)(const D&, const S&)) {
  cls.def(
      "check", [check](const S& s, const D& dims) { check(dims, s); }, py::arg("dims"),
      "Raise ValueError naming the field (and the launcher) when these arguments do not fit `dims`: what "
      "the context's launch method checks before it launches.");
  return cls;
}

}  // namespace named_args
}  // namespace moe_ep
