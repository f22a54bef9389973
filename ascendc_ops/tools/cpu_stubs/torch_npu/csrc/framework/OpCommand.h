// CPU stand-in for a CANN / torch_npu header: only what ascendc_ops/host uses, so the host code
// compiles and registers on a machine without CANN (tools/host_check_cpu.sh). Launches do nothing.
#pragma once
#include <functional>
#include <string>
namespace at_npu { namespace native { class OpCommand { public:
  OpCommand &Name(const std::string &) { return *this; }
  OpCommand &SetCustomHandler(std::function<int()> f) { f_ = f; return *this; }
  void Run() { f_(); }
  std::function<int()> f_; }; } }
