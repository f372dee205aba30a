// The _C extension module of loom_torch: exposes the creator function that
// torch.distributed.Backend.register_backend calls.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/python.h>

#include "python/process_group_loom.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "loom as a torch.distributed backend (CPU tensors)";
  m.def("create_process_group", &loom_torch::ProcessGroupLoom::create, pybind11::arg("store"),
        pybind11::arg("rank"), pybind11::arg("size"), pybind11::arg("timeout"),
        pybind11::call_guard<pybind11::gil_scoped_release>(),
        "Creates a loom process group; the ranks meet through the c10d store.");
  m.def(
      "shrink",
      [](const c10::intrusive_ptr<loom_torch::GroupBase>& pg, const std::vector<int64_t>& exclude) {
        auto* loom = dynamic_cast<loom_torch::ProcessGroupLoom*>(pg.get());
        TORCH_CHECK(loom, "loom_torch.shrink: the group's backend is ", pg->getBackendName(), ", not loom");
        return c10::intrusive_ptr<loom_torch::GroupBase>(loom->shrink(exclude));
      },
      pybind11::arg("group"), pybind11::arg("exclude"),
      "Revokes a loom group and returns the group of its survivors (None on a rank left out).");
  m.def(
      "parent_ranks",
      [](const c10::intrusive_ptr<loom_torch::GroupBase>& pg) {
        auto* loom = dynamic_cast<loom_torch::ProcessGroupLoom*>(pg.get());
        TORCH_CHECK(loom, "loom_torch: not a loom group");
        return loom->parentRanks();
      },
      pybind11::arg("group"));
  m.def(
      "empty_bytes",
      [](int64_t bytes) {
        TORCH_CHECK(bytes >= 0, "loom_torch.empty: a negative size");
        return loom_torch::sharedEmpty(bytes, at::TensorOptions().dtype(at::kByte));
      },
      pybind11::arg("bytes"),
      "A uint8 CPU tensor of `bytes` bytes in loomMemAlloc memory when it is 1 MiB or more (loom_torch.empty).");
  m.def("loom_version", [] {
    int v = 0;
    loomGetVersion(&v);
    return v;
  });
}
