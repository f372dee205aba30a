// Who still maps a rank's device memory.
//
// CUDA says that freeing exported device memory before every process that
// opened its IPC handle has closed it is undefined behaviour
// (cudaIpcOpenMemHandle).  A rank's DeviceComm memory (its block, its
// send/recv regions) is mapped by every peer of its host until that peer's
// communicator is destroyed, and peers destroy in any order, so the owner
// must learn when each peer has closed its mappings, also after the owner's
// own communicator is gone, and also when a peer dies without closing.
//
// A board is an empty file the owner creates; each peer opens it at init,
// before it maps the owner's memory, and takes an open-file-description
// read lock on byte `peer rank` (F_OFD_SETLK).  It drops the lock (closes
// the file) once it has closed every mapping of the owner's memory.  The
// kernel drops it too when the peer's process exits or is killed.  So a
// byte that nobody locks means: that peer maps nothing of the owner's any
// more.  The owner asks with F_OFD_GETLK, from its destructor or from the
// reaper after it (device_comm.cc), and frees only then.  Open file
// description locks belong to the open file, not the process, so ranks that
// are threads of one process (the tests) lock against each other too.
//
// The file's name carries the owner's process token and a serial; the
// owner unlinks it once every peer has opened it (init's last exchange), so
// only a crash inside init leaves a name behind.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace loom {

// Where boards live: /dev/shm when it is a writable directory, else /tmp
// (the owner's choice: its board's id says which, so a peer that would
// choose otherwise still finds it).
constexpr uint32_t kMapBoardInTmp = 1u << 31;
bool mapBoardInTmp();
// A board's file: its owner's process token, its id (serial and directory bit).
std::string mapBoardPath(uint64_t process, uint32_t id);

// The owner's side.
class MapBoard {
 public:
  // Creates a new board (a fresh serial of this process).  Throws
  // loomSystemError naming the path when it cannot.
  explicit MapBoard(uint64_t process);
  ~MapBoard();
  MapBoard(const MapBoard&) = delete;
  MapBoard& operator=(const MapBoard&) = delete;
  uint32_t serial() const { return serial_; }  // the board's id (IpcRecord::board)
  const std::string& path() const { return path_; }
  // Removes the name (every peer has it open by now); idempotent.
  void unlink();
  // Whether some open file other than the owner's holds rank `peer`'s
  // byte: the peer may still map the owner's memory.  A failing query
  // counts as held (never free what may be mapped).
  bool held(int peer) const;
  // The ranks among `peers` that hold their byte now.
  std::vector<int> holders(const std::vector<int>& peers) const;

 private:
  int fd_ = -1;
  uint32_t serial_ = 0;
  std::string path_;
  bool linked_ = false;
};

// A peer's hold on an owner's board: opened and locked on construction,
// released (unlocked, then closed) on destruction.  A process forked while
// it holds shares the lock until the holder lets go or every copy of the
// file is closed.
class MapHold {
 public:
  // Opens the owner's board and locks byte `self`.  Throws loomSystemError
  // naming the path when it cannot.
  MapHold(uint64_t ownerProcess, uint32_t id, int self);
  ~MapHold();
  MapHold(const MapHold&) = delete;
  MapHold& operator=(const MapHold&) = delete;

 private:
  int fd_ = -1;
  int self_;
  int pid_;  // the holder (a forked child's copy is not)
};

}  // namespace loom
