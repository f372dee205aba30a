// Checkpoints: everything a run needs to continue on the same trajectory,
// in the logical parameter order (independent of bucket layout and padding).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace trainer {

struct Checkpoint {
  std::vector<int> widths;      // the model
  int optimizer = 0;            // OptKind
  int hook = 0;                 // Hook
  uint64_t nextStep = 0;        // the first step a resumed run executes
  int nranks = 0;               // ranks of the run that wrote it
  std::vector<float> params;    // logical order
  std::vector<float> state;     // optimizer state arrays, each in logical order
  std::vector<float> residual;  // top-k or PowerSGD error feedback: nranks arrays, logical order
  std::vector<float> warmStart; // PowerSGD's Q matrices (the same on every rank), its own layout
};

// Written to path.tmp and renamed, so a crash never leaves half a checkpoint.
bool writeCheckpoint(const std::string& path, const Checkpoint& c, std::string* error);
bool readCheckpoint(const std::string& path, Checkpoint* c, std::string* error);

}  // namespace trainer
