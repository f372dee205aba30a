// The _C extension module of loom_torch: exposes the creator function that
// torch.distributed.Backend.register_backend calls.
#include <pybind11/chrono.h>
#include <torch/python.h>

#include "python/process_group_loom.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "loom as a torch.distributed backend (CPU tensors)";
  m.def("create_process_group", &loom_torch::ProcessGroupLoom::create, pybind11::arg("store"),
        pybind11::arg("rank"), pybind11::arg("size"), pybind11::arg("timeout"),
        pybind11::call_guard<pybind11::gil_scoped_release>(),
        "Creates a loom process group; the ranks meet through the c10d store.");
  m.def("loom_version", [] {
    int v = 0;
    loomGetVersion(&v);
    return v;
  });
}
