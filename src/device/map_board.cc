// Who still maps a rank's device memory (map_board.h): an empty file and
// open-file-description locks on it.
#include "src/device/map_board.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "src/core/error.h"

namespace loom {

namespace {

std::atomic<uint32_t> nextSerial{0};

struct flock byteLock(short type, int byte) {
  struct flock l;
  memset(&l, 0, sizeof l);  // l_pid must be 0 for the OFD commands
  l.l_type = type;
  l.l_whence = SEEK_SET;
  l.l_start = byte;
  l.l_len = 1;
  return l;
}

}  // namespace

bool mapBoardInTmp() {
  static const bool tmp = [] {
    struct stat st;
    return !(stat("/dev/shm", &st) == 0 && S_ISDIR(st.st_mode) && access("/dev/shm", W_OK | X_OK) == 0);
  }();
  return tmp;
}

std::string mapBoardPath(uint64_t process, uint32_t id) {
  return strf("%s/loom-maps-%016llx-%u", id & kMapBoardInTmp ? "/tmp" : "/dev/shm", (unsigned long long)process,
              id & ~kMapBoardInTmp);
}

MapBoard::MapBoard(uint64_t process) {
  // A name left by a process killed inside init (tokens are random, but a
  // test's may repeat) is skipped, never reused: a peer may hold it.
  for (int tries = 0; fd_ < 0 && tries < 64; ++tries) {
    serial_ = (++nextSerial & ~kMapBoardInTmp) | (mapBoardInTmp() ? kMapBoardInTmp : 0);
    path_ = mapBoardPath(process, serial_);
    fd_ = open(path_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd_ < 0 && errno != EEXIST) break;
  }
  if (fd_ < 0)
    fail(loomSystemError, "cannot create %s (where peers say they map this rank's device memory): %s",
         path_.c_str(), strerror(errno));
  linked_ = true;
}

MapBoard::~MapBoard() {
  unlink();
  if (fd_ >= 0) close(fd_);
}

void MapBoard::unlink() {
  if (linked_) ::unlink(path_.c_str());
  linked_ = false;
}

bool MapBoard::held(int peer) const {
  struct flock l = byteLock(F_WRLCK, peer);
  // No open-file-description locks here (EINVAL: a kernel before 3.15):
  // no peer can have taken one either.  Any other failure: held.
  if (fcntl(fd_, F_OFD_GETLK, &l) != 0) return errno != EINVAL;
  return l.l_type != F_UNLCK;
}

std::vector<int> MapBoard::holders(const std::vector<int>& peers) const {
  std::vector<int> out;
  for (int p : peers)
    if (held(p)) out.push_back(p);
  return out;
}

MapHold::MapHold(uint64_t ownerProcess, uint32_t id, int self) : self_(self), pid_(getpid()) {
  const std::string path = mapBoardPath(ownerProcess, id);
  fd_ = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) fail(loomSystemError, "cannot open %s: %s", path.c_str(), strerror(errno));
  struct flock l = byteLock(F_RDLCK, self);
  if (fcntl(fd_, F_OFD_SETLK, &l) != 0) {
    const int e = errno;
    close(fd_);
    fd_ = -1;
    fail(loomSystemError, "cannot lock byte %d of %s: %s", self, path.c_str(), strerror(e));
  }
}

MapHold::~MapHold() {
  if (fd_ < 0) return;
  // Unlocked first: a child forked since (a data loader's worker, say)
  // shares this open file, and closing would leave the lock to it.  A
  // forked child closes its copy only: the lock is its parent's.
  if (getpid() == pid_) {
    struct flock l = byteLock(F_UNLCK, self_);
    fcntl(fd_, F_OFD_SETLK, &l);
  }
  close(fd_);
}

}  // namespace loom
