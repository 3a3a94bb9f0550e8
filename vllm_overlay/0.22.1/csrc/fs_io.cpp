// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vLLM project
//
// The fs_python tier's common case in C: a new block file stored, or a
// block file loaded, in one call that releases the GIL once. In Python
// each of the block's syscalls (open, write, close, rename) is a GIL
// hand-over between the tier's I/O threads, and those hand-overs, not the
// disk, bounded the tier at small (HMA per-group) block files.
//
// Only the path where nothing is unusual is here; anything else (a missing
// directory, a name already taken, a short file, a symbolic link, an error)
// is answered with a code, and io.py takes its Python path for that block,
// which decides and reports as before. So every decision of the tier stays
// in one place (io.py), and this file stays small.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <cstdint>
#include <vector>

// The crc32 instruction, used where the CPU has it (checked at run time).
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  #include <nmmintrin.h>
  #define FS_IO_HAVE_SSE42_DISPATCH 1
#endif

// openat2 (Linux 5.6) on the architectures whose syscall table numbers it
// 437, as io.py's _OPENAT2_MACHINES; declared here rather than taken from
// <linux/openat2.h>, which older build images (manylinux_2_28) lack.
// Elsewhere HAVE_OPENAT2 is 0 and io.py never calls in.
#if defined(__linux__) &&                                      \
    (defined(__x86_64__) || defined(__aarch64__) ||            \
     (defined(__powerpc64__) && defined(__LITTLE_ENDIAN__)) || \
     defined(__s390x__) || (defined(__riscv) && __riscv_xlen == 64))
  #define FS_IO_HAVE_OPENAT2 1
#endif

extern "C" {

namespace {

// Results (io.py: _C_PUBLISHED, _C_UNPUBLISHED; a negative errno: take the
// Python path, this call left nothing behind).
constexpr int kDone = 0;
// store: the temp file is complete, but RENAME_NOREPLACE did not publish it
// (the name is taken, or the file system lacks the flag): io.py decides.
constexpr int kUnpublished = 1;
constexpr size_t kAlign = 4096;  // O_DIRECT's buffer and length alignment
#ifdef O_DIRECT
constexpr int kODirect = O_DIRECT;
#else
constexpr int kODirect = 0;
#endif

// CRC32C (Castagnoli, reflected, as iSCSI and ext4): the SSE4.2 crc32
// instruction where the CPU has it, else slicing-by-8 tables; chosen once at
// run time (the extension is built for the baseline ISA).
struct Crc32cTables {
  uint32_t t[8][256];
  Crc32cTables() {
    for (uint32_t i = 0; i < 256; i++) {
      uint32_t crc = i;
      for (int k = 0; k < 8; k++) {
        crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));
      }
      t[0][i] = crc;
    }
    for (uint32_t i = 0; i < 256; i++) {
      for (int k = 1; k < 8; k++) {
        t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xFF];
      }
    }
  }
};

inline uint32_t crc32c_table(uint32_t crc, const unsigned char* p, size_t n) {
  static const Crc32cTables tables;
  const auto& t = tables.t;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t word;
    memcpy(&word, p, sizeof(word));
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    word = __builtin_bswap64(word);  // the tables index bytes in file order
#endif
    word ^= crc;  // in file order: the CRC covers the first 4 bytes
    crc = t[7][word & 0xFF] ^ t[6][(word >> 8) & 0xFF] ^
          t[5][(word >> 16) & 0xFF] ^ t[4][(word >> 24) & 0xFF] ^
          t[3][(word >> 32) & 0xFF] ^ t[2][(word >> 40) & 0xFF] ^
          t[1][(word >> 48) & 0xFF] ^ t[0][word >> 56];
  }
  for (; n > 0; n--, p++) {
    crc = (crc >> 8) ^ t[0][(crc ^ *p) & 0xFF];
  }
  return crc;
}

#if defined(FS_IO_HAVE_SSE42_DISPATCH)
// The CRC32C register after `len` more zero bytes, as a table per byte of
// the register (the update is linear): combines the CRCs of lanes computed
// independently.
struct Crc32cShift {
  uint32_t t[4][256];
  explicit Crc32cShift(size_t len) {
    const std::vector<unsigned char> zeros(len, 0);
    uint32_t basis[32];
    for (int bit = 0; bit < 32; bit++) {
      basis[bit] = crc32c_table(1u << bit, zeros.data(), len);
    }
    for (int k = 0; k < 4; k++) {
      for (uint32_t b = 0; b < 256; b++) {
        uint32_t v = 0;
        for (int bit = 0; bit < 8; bit++) {
          v ^= (b >> bit) & 1u ? basis[8 * k + bit] : 0u;
        }
        t[k][b] = v;
      }
    }
  }
  uint32_t operator()(uint32_t crc) const {
    return t[0][crc & 0xFF] ^ t[1][(crc >> 8) & 0xFF] ^
           t[2][(crc >> 16) & 0xFF] ^ t[3][crc >> 24];
  }
};

// Three lanes of `lane` bytes at a time: the crc32 instruction has a
// latency of 3 cycles and a throughput of 1, so one dependency chain runs at
// a third of its speed.
__attribute__((target("sse4.2"))) inline uint32_t crc32c_sse42_lanes(
    uint32_t crc, const unsigned char*& p, size_t& n, size_t lane,
    const Crc32cShift& shift) {
  for (; n >= 3 * lane; n -= 3 * lane, p += 3 * lane) {
    uint64_t a = crc, b = 0, c = 0;
    for (size_t i = 0; i < lane; i += 8) {
      uint64_t wa, wb, wc;
      memcpy(&wa, p + i, 8);
      memcpy(&wb, p + lane + i, 8);
      memcpy(&wc, p + 2 * lane + i, 8);
      a = _mm_crc32_u64(a, wa);
      b = _mm_crc32_u64(b, wb);
      c = _mm_crc32_u64(c, wc);
    }
    crc = shift(static_cast<uint32_t>(a)) ^ static_cast<uint32_t>(b);
    crc = shift(crc) ^ static_cast<uint32_t>(c);
  }
  return crc;
}

__attribute__((target("sse4.2"))) inline uint32_t crc32c_sse42(
    uint32_t crc, const unsigned char* p, size_t n) {
  constexpr size_t kLongLane = 8192, kShortLane = 256;
  static const Crc32cShift shift_long(kLongLane), shift_short(kShortLane);
  crc = crc32c_sse42_lanes(crc, p, n, kLongLane, shift_long);
  crc = crc32c_sse42_lanes(crc, p, n, kShortLane, shift_short);
  uint64_t crc64 = crc;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t word;
    memcpy(&word, p, sizeof(word));
    crc64 = _mm_crc32_u64(crc64, word);
  }
  crc = static_cast<uint32_t>(crc64);
  for (; n > 0; n--, p++) {
    crc = _mm_crc32_u8(crc, *p);
  }
  return crc;
}
#endif

// The CRC32C register after *n* more bytes at *p*.
uint32_t crc32c_update(uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
#if defined(FS_IO_HAVE_SSE42_DISPATCH)
  static const bool has_sse42 = __builtin_cpu_supports("sse4.2");
  if (has_sse42) {
    return crc32c_sse42(crc, p, n);
  }
#endif
  return crc32c_table(crc, p, n);
}

// io.py's BlockChecksum("crc32c"): the CRC32C of the block's key, then of
// its bytes, as the 8 little-endian bytes its extended attribute holds.
constexpr size_t kDigestSize = 8;
struct Checksum {
  const char* xattr = nullptr;  // nullptr: no checksum
  const char* key = nullptr;
  size_t key_len = 0;
  void compute(const char* data, size_t n,
               unsigned char out[kDigestSize]) const {
    uint32_t crc = ~crc32c_update(crc32c_update(~0u, key, key_len), data, n);
    for (size_t i = 0; i < kDigestSize; i++) {
      out[i] = i < 4 ? static_cast<unsigned char>(crc >> (8 * i)) : 0;
    }
  }
};

struct Run {
  Py_ssize_t offset;
  Py_ssize_t length;
};

// This thread's page-aligned buffer for a group file gathered from (or
// scattered to) its runs of the row: grown to the largest file, freed when
// the thread ends.
struct Bounce {
  void* data = nullptr;
  size_t size = 0;
  ~Bounce() { free(data); }
  char* get(size_t n) {
    if (n > size) {
      void* grown = nullptr;
      if (posix_memalign(&grown, kAlign, (n + kAlign - 1) / kAlign * kAlign)) {
        return nullptr;
      }
      free(data);
      data = grown;
      size = n;
    }
    return static_cast<char*>(data);
  }
};
thread_local Bounce bounce;

#ifdef FS_IO_HAVE_OPENAT2
// io.py's _open_without_links(): a symbolic link at any component of the
// path fails the open (ELOOP) instead of being followed.
constexpr long kSysOpenat2 = 437;
constexpr uint64_t kResolveNoSymlinks = 0x04;
struct OpenHow {  // struct open_how
  uint64_t flags, mode, resolve;
};

int open_without_links(const char* path, int flags, mode_t mode) {
  OpenHow how = {};
  how.flags = static_cast<uint64_t>(flags | O_CLOEXEC);
  how.mode = (flags & O_CREAT) ? mode : 0;
  how.resolve = kResolveNoSymlinks;
  long fd = syscall(kSysOpenat2, AT_FDCWD, path, &how, sizeof(how));
  return fd < 0 ? -errno : static_cast<int>(fd);
}

// One write, as io.py's writev: a failed or short one (-EIO) goes to io.py,
// which writes the block again and says why if that fails too.
int write_block(int fd, const char* data, size_t n) {
  ssize_t written = write(fd, data, n);
  if (written < 0) {
    return -errno;
  }
  return static_cast<size_t>(written) == n ? 0 : -EIO;
}

int store(const char* tmp_path, const char* dest_path, char* row,
          const std::vector<Run>& runs, bool in_place, size_t size, int flags,
          mode_t mode, bool chmod, const Checksum& checksum) {
  const char* data = row;
  if (!in_place) {
    char* buf = bounce.get(size);
    if (buf == nullptr) {
      return -ENOMEM;
    }
    size_t pos = 0;
    for (const Run& r : runs) {
      memcpy(buf + pos, row + r.offset, r.length);
      pos += r.length;
    }
    memset(buf + pos, 0, size - pos);
    data = buf;
  }
  int fd =
      open_without_links(tmp_path, O_CREAT | O_EXCL | O_WRONLY | flags, mode);
  if (fd < 0) {
    return fd;
  }
  int rc = 0;
  if (chmod && fchmod(fd, mode) != 0) {
    rc = -errno;
  }
  if (rc == 0) {
    rc = write_block(fd, data, size);
  }
  if (rc == 0 && checksum.xattr != nullptr) {
    // set before the file is published: a block file appears with it
    unsigned char value[kDigestSize];
    checksum.compute(data, size, value);
    if (fsetxattr(fd, checksum.xattr, value, kDigestSize, 0) != 0) {
      rc = -errno;
    }
  }
  if (close(fd) != 0 && rc == 0) {
    rc = -errno;
  }
  if (rc != 0) {
    unlink(tmp_path);
    return rc;
  }
  if (renameat2(AT_FDCWD, tmp_path, AT_FDCWD, dest_path, RENAME_NOREPLACE)) {
    rc = errno;
    if (rc == EEXIST || rc == EINVAL || rc == ENOSYS || rc == EOPNOTSUPP) {
      return kUnpublished;  // the name is taken, or the flag unsupported
    }
    unlink(tmp_path);
    return -rc;
  }
  return kDone;
}

int load(const char* path, char* row, const std::vector<Run>& runs,
         bool in_place, size_t size, int flags, const Checksum& checksum) {
  int fd = open_without_links(path, O_RDONLY | flags, 0);
  if (fd < 0) {
    return fd;
  }
  char* dst = in_place ? row : bounce.get(size);
  int rc = 0;
  struct stat st;
  if (dst == nullptr) {
    rc = -ENOMEM;
  } else if (fstat(fd, &st) != 0) {
    rc = -errno;
  } else if (!S_ISREG(st.st_mode) || static_cast<size_t>(st.st_size) != size) {
    rc = -EINVAL;  // not a block file: io.py's load says what it is
  } else {
    ssize_t got = read(fd, dst, size);
    rc = got < 0 ? -errno : (static_cast<size_t>(got) == size ? 0 : -EIO);
  }
  unsigned char stored[kDigestSize], computed[kDigestSize];
  if (rc == 0 && checksum.xattr != nullptr) {
    // read from the fd that was read (the path may be replaced meanwhile)
    ssize_t n = fgetxattr(fd, checksum.xattr, stored, kDigestSize);
    rc = n == static_cast<ssize_t>(kDigestSize) ? 0 : -EBADMSG;
  }
  close(fd);  // a read-only fd: nothing to lose
  if (rc == 0 && checksum.xattr != nullptr) {
    checksum.compute(dst, size, computed);
    if (memcmp(stored, computed, kDigestSize) != 0) {
      rc = -EBADMSG;  // io.py reads it again, and fails it as damaged
    }
  }
  if (rc == 0 && !in_place) {
    size_t pos = 0;
    for (const Run& r : runs) {
      memcpy(row + r.offset, dst + pos, r.length);
      pos += r.length;
    }
  }
  return rc;
}
#else
int store(const char*, const char*, char*, const std::vector<Run>&, bool,
          size_t, int, mode_t, bool, const Checksum&) {
  return -ENOSYS;
}
int load(const char*, char*, const std::vector<Run>&, bool, size_t, int,
         const Checksum&) {
  return -ENOSYS;
}
#endif

// Where a block's bytes are in *row* (row_len bytes): with *runs* None, the
// *size* bytes at *offset* (in_place); else the (offset from *offset*,
// length) pairs of *runs*, whose lengths sum to at most *size*. False, with
// an exception set, for anything outside the row (no sum that can overflow).
bool parse_runs(PyObject* runs, Py_ssize_t offset, Py_ssize_t size,
                Py_ssize_t row_len, std::vector<Run>& out, bool& in_place) {
  if (offset < 0 || offset > row_len || size < 0) {
    PyErr_SetString(PyExc_ValueError, "block outside the row buffer");
    return false;
  }
  in_place = runs == Py_None;
  if (in_place) {
    if (size > row_len - offset) {
      PyErr_SetString(PyExc_ValueError, "block outside the row buffer");
      return false;
    }
    return true;
  }
  Py_ssize_t n = PySequence_Size(runs);
  if (n < 0) {
    return false;
  }
  out.reserve(n);
  Py_ssize_t left = size;  // of the file, for the runs still to come
  for (Py_ssize_t i = 0; i < n; i++) {
    Py_ssize_t field[2] = {-1, -1};
    PyObject* pair = PySequence_GetItem(runs, i);
    for (Py_ssize_t j = 0; pair != nullptr && j < 2; j++) {
      PyObject* item = PySequence_GetItem(pair, j);
      if (item != nullptr) {
        field[j] = PyLong_AsSsize_t(item);
        Py_DECREF(item);
      }
    }
    Py_XDECREF(pair);
    if (PyErr_Occurred()) {
      return false;
    }
    Run r = {field[0], field[1]};
    if (r.offset < 0 || r.offset > row_len - offset || r.length < 0 ||
        r.length > row_len - offset - r.offset || r.length > left) {
      PyErr_SetString(PyExc_ValueError, "run outside the row buffer or file");
      return false;
    }
    r.offset += offset;
    left -= r.length;
    out.push_back(r);
  }
  return true;
}

}  // namespace

static PyObject* store_new_block(PyObject* /*self*/, PyObject* args) {
  PyObject *tmp_path = nullptr, *dest_path = nullptr;  // bytes (os.fsencode)
  PyObject *row_obj, *runs_obj;
  Py_ssize_t offset, size;
  int direct, mode, chmod;
  Checksum checksum;
  Py_ssize_t key_len = 0;
  if (!PyArg_ParseTuple(args, "O&O&OnnOpipzy#", PyUnicode_FSConverter,
                        &tmp_path, PyUnicode_FSConverter, &dest_path, &row_obj,
                        &offset, &size, &runs_obj, &direct, &mode, &chmod,
                        &checksum.xattr, &checksum.key, &key_len)) {
    return nullptr;  // the converters release what they made
  }
  PyObject* result = nullptr;
  Py_buffer row;
  std::vector<Run> runs;
  bool in_place;
  if (PyObject_GetBuffer(row_obj, &row, PyBUF_SIMPLE) == 0) {
    if (parse_runs(runs_obj, offset, size, row.len, runs, in_place)) {
      char* start = static_cast<char*>(row.buf) + (in_place ? offset : 0);
      const char* tmp = PyBytes_AsString(tmp_path);
      const char* dest = PyBytes_AsString(dest_path);
      int rc;
      checksum.key_len = static_cast<size_t>(key_len);
      Py_BEGIN_ALLOW_THREADS;
      rc = store(tmp, dest, start, runs, in_place, static_cast<size_t>(size),
                 direct ? kODirect : 0, static_cast<mode_t>(mode), chmod,
                 checksum);
      Py_END_ALLOW_THREADS;
      result = PyLong_FromLong(rc);
    }
    PyBuffer_Release(&row);
  }
  Py_DECREF(tmp_path);
  Py_DECREF(dest_path);
  return result;
}

static PyObject* load_block(PyObject* /*self*/, PyObject* args) {
  PyObject* path = nullptr;  // bytes (os.fsencode)
  PyObject *row_obj, *runs_obj;
  Py_ssize_t offset, size;
  int direct;
  Checksum checksum;
  Py_ssize_t key_len = 0;
  if (!PyArg_ParseTuple(args, "O&OnnOpzy#", PyUnicode_FSConverter, &path,
                        &row_obj, &offset, &size, &runs_obj, &direct,
                        &checksum.xattr, &checksum.key, &key_len)) {
    return nullptr;
  }
  PyObject* result = nullptr;
  Py_buffer row;
  std::vector<Run> runs;
  bool in_place;
  if (PyObject_GetBuffer(row_obj, &row, PyBUF_WRITABLE) == 0) {
    if (parse_runs(runs_obj, offset, size, row.len, runs, in_place)) {
      char* start = static_cast<char*>(row.buf) + (in_place ? offset : 0);
      const char* source = PyBytes_AsString(path);
      int rc;
      checksum.key_len = static_cast<size_t>(key_len);
      Py_BEGIN_ALLOW_THREADS;
      rc = load(source, start, runs, in_place, static_cast<size_t>(size),
                direct ? kODirect : 0, checksum);
      Py_END_ALLOW_THREADS;
      result = PyLong_FromLong(rc);
    }
    PyBuffer_Release(&row);
  }
  Py_DECREF(path);
  return result;
}

static PyObject* crc32c(PyObject* /*self*/, PyObject* args) {
  Checksum checksum;
  Py_ssize_t key_len = 0;
  Py_buffer data;
  if (!PyArg_ParseTuple(args, "y#y*", &checksum.key, &key_len, &data)) {
    return nullptr;
  }
  checksum.key_len = static_cast<size_t>(key_len);
  unsigned char value[kDigestSize];
  Py_BEGIN_ALLOW_THREADS;
  checksum.compute(static_cast<const char*>(data.buf),
                   static_cast<size_t>(data.len), value);
  Py_END_ALLOW_THREADS;
  PyBuffer_Release(&data);
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(value),
                                   kDigestSize);
}

static PyMethodDef fs_io_C_methods[] = {
    {"store_new_block", store_new_block, METH_VARARGS,
     "store_new_block(tmp_path, dest_path, row, offset, size, runs, direct,\n"
     "                file_mode, chmod, xattr, key) -> int\n"
     "\n"
     "Write a block to a new temp file (openat2 RESOLVE_NO_SYMLINKS, O_EXCL)\n"
     "and publish it with RENAME_NOREPLACE, the GIL released once. 0:\n"
     "published; 1: written but not published (the temp file is left);\n"
     "-errno: nothing left behind. With an xattr name, the block's crc32c\n"
     "checksum (of key, then the block) is set as that xattr first."},
    {"load_block", load_block, METH_VARARGS,
     "load_block(path, row, offset, size, runs, direct, xattr, key) -> int\n"
     "\n"
     "Read a regular file of exactly size bytes (openat2\n"
     "RESOLVE_NO_SYMLINKS) into the row, the GIL released once. 0: loaded;\n"
     "-errno: not loaded (the row's bytes are undefined; -EBADMSG: the\n"
     "crc32c checksum in the xattr, if named, is missing or differs)."},
    {"crc32c", crc32c, METH_VARARGS,
     "crc32c(key: bytes, data: bytes-like) -> bytes\n"
     "\n"
     "The crc32c checksum of key, then data, as the 8 bytes the block\n"
     "file's xattr holds (little-endian, the upper 4 zero)."},
    {nullptr, nullptr, 0, nullptr},
};

static struct PyModuleDef fs_io_C_module = {
    PyModuleDef_HEAD_INIT,
    "fs_io_C",
    "The fs_python tier's block stores and loads in C",
    -1,
    fs_io_C_methods,
};

PyMODINIT_FUNC PyInit_fs_io_C(void) {
  PyObject* module = PyModule_Create(&fs_io_C_module);
#ifdef FS_IO_HAVE_OPENAT2
  constexpr long kHaveOpenat2 = 1;
#else
  constexpr long kHaveOpenat2 = 0;  // every call answers -ENOSYS
#endif
  if (module != nullptr &&
      PyModule_AddIntConstant(module, "HAVE_OPENAT2", kHaveOpenat2) != 0) {
    Py_CLEAR(module);
  }
  return module;
}

}  // extern "C"
