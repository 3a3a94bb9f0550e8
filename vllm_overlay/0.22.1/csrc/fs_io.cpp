// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vLLM project

#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(FS_IO_NO_SSE42)
  #include <nmmintrin.h>
  #define FS_IO_HAVE_SSE42_DISPATCH 1
#endif

#if defined(O_DIRECT)
constexpr int kODirectFlag = O_DIRECT;
#else
constexpr int kODirectFlag = 0;
#endif

extern "C" {

namespace {

// The extended attribute that holds a block file's CRC32C (the tier's
// checksum_blocks option; upstream #57912's name), 4 bytes little-endian. It
// is set on the temp file before the rename, so a block file appears with it.
constexpr char kCrcXattr[] = "user.vllm.kv_crc32c";
constexpr size_t kCrcSize = 4;

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

inline uint32_t crc32c(const void* data, size_t size) {
  const auto* p = static_cast<const unsigned char*>(data);
#if defined(FS_IO_HAVE_SSE42_DISPATCH)
  static const bool has_sse42 = __builtin_cpu_supports("sse4.2");
  if (has_sse42) {
    return ~crc32c_sse42(~0u, p, size);
  }
#endif
  return ~crc32c_table(~0u, p, size);
}

// The CRC32C of `size` bytes at `data` as the xattr holds it.
inline void crc32c_bytes(const void* data, size_t size,
                         unsigned char out[kCrcSize]) {
  const uint32_t crc = crc32c(data, size);
  for (size_t i = 0; i < kCrcSize; i++) {
    out[i] = static_cast<unsigned char>(crc >> (8 * i));
  }
}

// Creates the missing parent directories of `path` with exactly `dir_mode`
// (mkdir, then fchmod: std::filesystem::create_directories and mkdir alone
// give 0777 & ~umask). KV blocks are users' data: the tier's directories are
// private (0700) unless the tier shares its root with a group. Returns 0 on
// success, or the errno of the failing step.
inline int ensure_parent_dirs(const std::string& path, mode_t dir_mode) {
  std::vector<std::filesystem::path> missing;
  struct stat st;
  for (auto dir = std::filesystem::path(path).parent_path();
       !dir.empty() && stat(dir.c_str(), &st) != 0; dir = dir.parent_path()) {
    missing.push_back(dir);
    if (dir == dir.parent_path()) {
      break;
    }
  }
  for (auto it = missing.rbegin(); it != missing.rend(); ++it) {
    if (mkdir(it->c_str(), dir_mode) != 0) {
      if (errno == EEXIST) {
        continue;  // created by another thread or engine meanwhile
      }
      return errno;
    }
    // Through an fd opened without following a link: whoever may write the
    // parent could have put one there meanwhile, and chmod(path) would change
    // the link's target.
    const int dir_fd =
        open(it->c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (dir_fd < 0) {
      return errno;
    }
    const int err = fchmod(dir_fd, dir_mode) != 0 ? errno : 0;
    close(dir_fd);
    if (err != 0) {
      return err;
    }
  }
  return 0;
}

// Whether `st` (from lstat of a block's path: a symlink is seen as one, not
// followed) is a regular file of exactly `size` bytes. Stores are atomic and
// write exactly one block, so anything else at the path (an empty, truncated
// or longer file, a directory) is not a stored block.
inline bool is_complete_block(const struct stat& st, size_t size) {
  return S_ISREG(st.st_mode) && static_cast<size_t>(st.st_size) == size;
}

// Whether the file at `path` (not followed if a link) has `value` as its
// `name` attribute; compared in constant time (the value is a MAC).
inline bool has_xattr_value(const char* path, const char* name,
                            const void* value, size_t size) {
  unsigned char stored[64];
  if (size > sizeof(stored)) {
    return false;
  }
  const ssize_t len = lgetxattr(path, name, stored, sizeof(stored));
  if (len < 0 || static_cast<size_t>(len) != size) {
    return false;
  }
  const auto* expected = static_cast<const unsigned char*>(value);
  unsigned char diff = 0;
  for (size_t i = 0; i < size; i++) {
    diff |= stored[i] ^ expected[i];
  }
  return diff == 0;
}

// Whether the store of a block to `path` is already done: a complete block
// is there and, with an `xattr_name`, holds this block's value (its MAC),
// with a `crc`, this block's CRC32C: else a planted or damaged file, or one
// restored without its xattrs, would be kept as this key's block.
inline bool is_stored(const char* path, const struct stat& st, size_t size,
                      const char* xattr_name, const void* xattr_value,
                      size_t xattr_size, const unsigned char* crc) {
  return is_complete_block(st, size) &&
         (xattr_name == nullptr ||
          has_xattr_value(path, xattr_name, xattr_value, xattr_size)) &&
         (crc == nullptr || has_xattr_value(path, kCrcXattr, crc, kCrcSize));
}

// Core single-block store: src/size are raw pointer + byte count. Returns 0
// on success, or the errno of the failing step on failure -- captured
// before any subsequent cleanup call can overwrite it. On failure, the temp
// file is removed. `tmp_path` is in `dest_path`'s directory: the directories
// are created when the temp file cannot be (ENOENT). Files are created with
// exactly `file_mode` (fchmod after open, whatever the umask), directories
// with `dir_mode`. With an `xattr_name`, `xattr_value` is set on the temp
// file before the rename (the block's MAC: the file appears with it); with
// `checksum`, the block's CRC32C likewise (kCrcXattr).
inline int _store_block(const char* tmp_path, const char* dest_path,
                        const char* src, size_t size, bool use_o_direct,
                        mode_t file_mode, mode_t dir_mode,
                        const char* xattr_name, const void* xattr_value,
                        size_t xattr_size, bool checksum) {
  unsigned char crc_value[kCrcSize];
  const unsigned char* crc = nullptr;
  if (checksum) {
    crc32c_bytes(src, size, crc_value);
    crc = crc_value;
  }
  // One lstat decides both whether the block is stored and whether a
  // directory is in the way.
  struct stat st;
  const bool exists = lstat(dest_path, &st) == 0;
  if (exists && is_stored(dest_path, st, size, xattr_name, xattr_value,
                          xattr_size, crc)) {
    return 0;  // Already present. Anything else at the path is replaced.
  }

  // A directory in the way cannot be replaced by a file: remove it if empty,
  // fail the store of this block if not.
  if (exists && S_ISDIR(st.st_mode) && rmdir(dest_path) != 0) {
    return errno;
  }

  const int o_direct_flag = use_o_direct ? kODirectFlag : 0;
  const int flags = O_CREAT | O_EXCL | O_WRONLY | O_TRUNC | o_direct_flag;
  int fd = open(tmp_path, flags, file_mode);
  if (fd < 0 && errno == ENOENT) {
    if (const int err = ensure_parent_dirs(dest_path, dir_mode); err != 0) {
      return err;
    }
    fd = open(tmp_path, flags, file_mode);
  }
  if (fd < 0) {
    return errno;
  }
  if (fchmod(fd, file_mode) != 0) {
    const int err = errno;
    close(fd);
    unlink(tmp_path);
    return err;
  }

  const ssize_t written = write(fd, src, size);
  if (written < 0 || static_cast<size_t>(written) != size) {
    const int err = written < 0 ? errno : EIO;
    close(fd);  // Best-effort cleanup; the real error is already captured.
    unlink(tmp_path);
    return err;
  }

  if ((xattr_name != nullptr &&
       fsetxattr(fd, xattr_name, xattr_value, xattr_size, 0) != 0) ||
      (crc != nullptr && fsetxattr(fd, kCrcXattr, crc, kCrcSize, 0) != 0)) {
    const int err = errno;
    close(fd);
    unlink(tmp_path);
    return err;
  }

  if (close(fd) != 0) {
    const int err = errno;
    unlink(tmp_path);
    return err;
  }

  if (rename(tmp_path, dest_path) != 0) {
    const int err = errno;
    unlink(tmp_path);
    // Another writer published this block after the check above; some
    // shared filesystems fail rename(2) with EEXIST instead of replacing.
    // A file name stands for one block, so a complete file already in place
    // (holding this block's xattr value, if any) holds this block and the
    // store is done.
    if (err != EEXIST) {
      return err;
    }
    struct stat now;
    return lstat(dest_path, &now) == 0 &&
                   is_stored(dest_path, now, size, xattr_name, xattr_value,
                             xattr_size, crc)
               ? 0
               : err;
  }

  return 0;
}

// Removes `path` if it still names the file `read_st` describes: another
// engine sharing the root may have stored the block anew since it was read.
// This narrows the window, it does not close it: a rename between the lstat
// and the unlink still loses that block (a miss). Callers hold the file open,
// so its inode cannot have been reused.
inline void unlink_if_same_file(const char* path, const struct stat& read_st) {
  struct stat now;
  if (lstat(path, &now) == 0 && now.st_dev == read_st.st_dev &&
      now.st_ino == read_st.st_ino) {
    unlink(path);
  }
}

// Core single-block load: dst/size are raw pointer + byte count. Returns 0
// on success, or the errno of the failing step on failure. Removes the source
// file ONLY if it provably holds no block: a regular file whose size is not
// `size`, or a short read (the read completed but returned fewer bytes than
// requested): stores are atomic and write exactly one block, so that is
// genuine corruption. A file of the wrong size, or one that is not a regular
// file, is rejected before anything is read into dst. Open failures and read
// errors (bytes_read < 0) are transient/ambiguous and leave the file
// untouched; a close failure after a full read is harmless and does not fail
// the load. With an `xattr_name`, its value is read into `xattr` from the
// same open file (empty if the file has none, or one too long to be ours),
// with the file's identity, so that the caller checks what it read. With
// `checksum`, the bytes read are checked against the file's CRC32C
// (kCrcXattr, read from the same open file): a mismatch, or a file without
// one, fails with EBADMSG and sets `*checksum_failed`; the file is removed
// if its path still names the file read (another engine may have stored the
// block anew meanwhile).
struct FileXattr {
  unsigned char value[64];
  size_t len = 0;
  dev_t dev = 0;
  ino_t ino = 0;
};

inline int _load_block(const char* source_path, char* dst, size_t size,
                       bool use_o_direct, const char* xattr_name,
                       FileXattr* xattr, bool checksum, bool* checksum_failed) {
  const int o_direct_flag = use_o_direct ? kODirectFlag : 0;
  // O_NOFOLLOW: a symbolic link at a block's path (planted by whoever could
  // write into the tree) is never read through (ELOOP, left untouched).
  // O_NONBLOCK: nor does a FIFO there block the open until a writer comes.
  // Once the file is known to be a regular one, O_NONBLOCK goes (Lustre
  // fails a read another node's lock holds with EAGAIN under it) and
  // O_DIRECT is set where asked: open(O_DIRECT) refuses a FIFO (EINVAL).
  const int fd =
      open(source_path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0);
  if (fd < 0) {
    return errno;
  }

  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    close(fd);
    return err;
  }
  if (!S_ISREG(st.st_mode)) {
    close(fd);
    return EBADMSG;  // not a block: is_block_error
  }
  if (static_cast<size_t>(st.st_size) != size) {
    unlink_if_same_file(source_path, st);
    close(fd);
    return EBADMSG;
  }
  // the fd's only status flags are these two: F_SETFL sets both at once
  if (fcntl(fd, F_SETFL, o_direct_flag) != 0) {
    const int err = errno;
    close(fd);
    return err;
  }

  const ssize_t bytes_read = read(fd, dst, size);
  if (bytes_read < 0) {
    // Transient read error: leave the file untouched.
    const int err = errno;
    close(fd);
    return err;
  }
  if (static_cast<size_t>(bytes_read) < size) {
    // Provable short read: the block is genuinely corrupt, so remove it.
    unlink_if_same_file(source_path, st);
    close(fd);
    return EBADMSG;
  }

  if (xattr_name != nullptr) {
    const ssize_t len =
        fgetxattr(fd, xattr_name, xattr->value, sizeof(xattr->value));
    if (len < 0 && errno != ENODATA && errno != ERANGE) {
      // Transient: leave the file untouched.
      const int err = errno;
      close(fd);
      return err;
    }
    xattr->len = len < 0 ? 0 : static_cast<size_t>(len);
    xattr->dev = st.st_dev;
    xattr->ino = st.st_ino;
  }

  if (checksum) {
    unsigned char stored[kCrcSize];
    const ssize_t len = fgetxattr(fd, kCrcXattr, stored, sizeof(stored));
    if (len < 0 && errno != ENODATA && errno != ERANGE) {
      // Transient: leave the file untouched.
      const int err = errno;
      close(fd);
      return err;
    }
    unsigned char computed[kCrcSize];
    crc32c_bytes(dst, size, computed);
    if (len != static_cast<ssize_t>(kCrcSize) ||
        memcmp(stored, computed, kCrcSize) != 0) {
      unlink_if_same_file(source_path, st);
      close(fd);
      *checksum_failed = true;
      return EBADMSG;
    }
  }

  // A close error after a successful full read is harmless: the data is
  // already in the destination buffer, so the load succeeds.
  close(fd);
  return 0;
}

// Whether `err` is a block's own failure (missing, not a whole block): a batch
// goes on past it, and stops at any other, which the next blocks would meet.
inline bool is_block_error(int err) {
  return err == ENOENT || err == ELOOP || err == EISDIR || err == ENOTDIR ||
         err == ENOTEMPTY || err == EEXIST || err == EBADMSG;
}

inline void _batch_lookup(const std::vector<const char*>& paths,
                          std::vector<int>& exists_flags) {
  for (size_t i = 0; i < paths.size(); i++) {
    // lstat: a symbolic link is a miss (never read through, see _load_block)
    struct stat st;
    exists_flags[i] =
        (lstat(paths[i], &st) == 0 && !S_ISLNK(st.st_mode)) ? 1 : 0;
  }
}

// Helper: extract a list[str] of length n into a vector<const char*>.
// Returns false and sets a Python exception on error.
inline bool extract_str_list(PyObject* list, Py_ssize_t n,
                             std::vector<const char*>& out) {
  for (Py_ssize_t i = 0; i < n; i++) {
    out[i] = PyUnicode_AsUTF8AndSize(PyList_GetItem(list, i), nullptr);
    if (out[i] == nullptr) {
      return false;
    }
  }
  return true;
}

// Helper: extract a Py_buffer per element of a list[bytes-like] of length n.
// On success, `out` holds n acquired buffers (caller must PyBuffer_Release
// each). On failure, any buffers already acquired are released before
// returning false, and a Python exception is set.
inline bool extract_buffer_list(PyObject* list, Py_ssize_t n, int flags,
                                std::vector<Py_buffer>& out) {
  for (Py_ssize_t i = 0; i < n; i++) {
    if (PyObject_GetBuffer(PyList_GetItem(list, i), &out[i], flags) != 0) {
      for (Py_ssize_t j = 0; j < i; j++) {
        PyBuffer_Release(&out[j]);
      }
      return false;
    }
  }
  return true;
}

inline void release_buffer_list(std::vector<Py_buffer>& buffers) {
  for (auto& buf : buffers) {
    PyBuffer_Release(&buf);
  }
}

// Helper: a new list[int] of `count` indices at `indices`, or nullptr (out of
// memory).
inline PyObject* index_list(const Py_ssize_t* indices, size_t count) {
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(count));
  for (size_t j = 0; list != nullptr && j < count; j++) {
    PyObject* index = PyLong_FromSsize_t(indices[j]);
    if (index == nullptr) {
      Py_CLEAR(list);
    } else {
      PyList_SetItem(list, static_cast<Py_ssize_t>(j), index);
    }
  }
  if (list == nullptr) {
    PyErr_Clear();  // the attribute is left out; the error raised is kept
  }
  return list;
}

}  // namespace

/// @brief Check file existence for a batch of paths.
/// @param paths list[str] – absolute paths to check.
/// @return list[bool] – True if the corresponding path exists and is not a
///         symbolic link, False otherwise.
/// @note Releases the GIL for the entire batch. File existence via lstat(2):
///       a symbolic link counts as missing.
static PyObject* batch_lookup(PyObject* /*self*/, PyObject* args) {
  PyObject* path_list;
  if (!PyArg_ParseTuple(args, "O!", &PyList_Type, &path_list)) {
    return nullptr;
  }

  const Py_ssize_t n = PyList_Size(path_list);
  std::vector<const char*> paths(n);
  for (Py_ssize_t i = 0; i < n; i++) {
    paths[i] = PyUnicode_AsUTF8AndSize(PyList_GetItem(path_list, i), nullptr);
    if (paths[i] == nullptr) {
      return nullptr;
    }
  }

  std::vector<int> exists_flags(n);
  {
    Py_BEGIN_ALLOW_THREADS _batch_lookup(paths, exists_flags);
    Py_END_ALLOW_THREADS
  }

  PyObject* result = PyList_New(n);
  if (result == nullptr) {
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    PyList_SetItem(result, i, PyBool_FromLong(exists_flags[i]));
  }
  return result;
}

/// @brief Store a batch of blocks, each from its own buffer, to disk.
/// @param tmp_paths    list[str] – one temp path per block, in its
///                     block's directory.
/// @param dest_paths   list[str] – one destination path per block.
/// @param buffers      list[bytes-like] – one source buffer per block.
/// @param use_o_direct bool – whether to open files with O_DIRECT
///                     (default True). Ignored where O_DIRECT is unsupported
///                     by the platform.
/// @param file_mode    int – the mode of the block files (default 0o600).
/// @param dir_mode     int – the mode of the directories created (default
///                     0o700). Both set exactly, whatever the umask.
/// @param xattr_name   str | None – an extended attribute to set on each
///                     block file before its rename (default None: none).
/// @param xattr_values list[bytes-like] – its value per block.
/// @param checksum     bool – set each block's CRC32C as kCrcXattr on its
///                     temp file before the rename (default False: none).
/// @note Releases the GIL for the entire batch. A block's own failure
///       (is_block_error) does not stop the batch, any other error does; if
///       any failed, raises the error that stopped it, else the first.
static PyObject* batch_store_block(PyObject* /*self*/, PyObject* args) {
  PyObject* tmp_paths_obj = nullptr;
  PyObject* dest_paths_obj = nullptr;
  PyObject* buffers_obj = nullptr;
  int use_o_direct = 1;
  unsigned int file_mode = 0600;
  unsigned int dir_mode = 0700;
  const char* xattr_name = nullptr;
  PyObject* xattr_values_obj = nullptr;
  int checksum = 0;

  if (!PyArg_ParseTuple(args,
                        "O!O!O!|pII"
                        "zO!p",
                        &PyList_Type, &tmp_paths_obj, &PyList_Type,
                        &dest_paths_obj, &PyList_Type, &buffers_obj,
                        &use_o_direct, &file_mode, &dir_mode, &xattr_name,
                        &PyList_Type, &xattr_values_obj, &checksum)) {
    return nullptr;
  }

  const Py_ssize_t n = PyList_Size(tmp_paths_obj);
  if (PyList_Size(dest_paths_obj) != n || PyList_Size(buffers_obj) != n) {
    PyErr_SetString(
        PyExc_ValueError,
        "tmp_paths, dest_paths and buffers must have the same length");
    return nullptr;
  }
  if (xattr_name != nullptr &&
      (xattr_values_obj == nullptr || PyList_Size(xattr_values_obj) != n)) {
    PyErr_SetString(PyExc_ValueError,
                    "xattr_values must give a value for each block");
    return nullptr;
  }

  std::vector<const char*> tmp_paths(n);
  std::vector<const char*> dest_paths(n);

  if (!extract_str_list(tmp_paths_obj, n, tmp_paths)) return nullptr;
  if (!extract_str_list(dest_paths_obj, n, dest_paths)) return nullptr;

  std::vector<Py_buffer> buffers(n);
  if (!extract_buffer_list(buffers_obj, n, PyBUF_SIMPLE, buffers)) {
    return nullptr;
  }
  std::vector<Py_buffer> xattr_values(xattr_name != nullptr ? n : 0);
  if (xattr_name != nullptr &&
      !extract_buffer_list(xattr_values_obj, n, PyBUF_SIMPLE, xattr_values)) {
    release_buffer_list(buffers);
    return nullptr;
  }

  // A block's own failure does not stop the batch: the others are stored.
  Py_ssize_t failed_index = -1;
  int failure_errno = 0;

  {
    Py_BEGIN_ALLOW_THREADS for (Py_ssize_t i = 0; i < n; i++) {
      const char* buf = static_cast<const char*>(buffers[i].buf);
      const Py_buffer* xattr =
          xattr_name != nullptr ? &xattr_values[i] : nullptr;
      const int err = _store_block(
          tmp_paths[i], dest_paths[i], buf, static_cast<size_t>(buffers[i].len),
          use_o_direct, static_cast<mode_t>(file_mode),
          static_cast<mode_t>(dir_mode), xattr_name,
          xattr != nullptr ? xattr->buf : nullptr,
          xattr != nullptr ? static_cast<size_t>(xattr->len) : 0, checksum);
      if (err != 0 && (failed_index < 0 || !is_block_error(err))) {
        failed_index = i;
        failure_errno = err;
      }
      if (err != 0 && !is_block_error(err)) {
        break;  // the blocks after it would meet it too
      }
    }
    Py_END_ALLOW_THREADS
  }

  release_buffer_list(buffers);
  release_buffer_list(xattr_values);

  if (failed_index >= 0) {
    // PyErr_SetFromErrnoWithFilename() reads the errno to format exception.
    errno = failure_errno;
    return PyErr_SetFromErrnoWithFilename(PyExc_OSError,
                                          dest_paths[failed_index]);
  }

  Py_RETURN_NONE;
}

/// @brief Load a batch of blocks from disk, each into its own buffer.
/// @param source_paths list[str] – one source path per block.
/// @param buffers      list[writable bytes-like] – one destination buffer
///                     per block.
/// @param use_o_direct bool – whether to open files with O_DIRECT
///                     (default True). Ignored where O_DIRECT is unsupported
///                     by the platform.
/// @param xattr_name   str | None – an extended attribute to read from each
///                     block file, through the fd the block was read from
///                     (default None: none).
/// @param checksum     bool – check each block read against its file's
///                     CRC32C (kCrcXattr); a mismatch or none fails the
///                     block with EBADMSG and removes the file (default
///                     False: no check).
/// @return None, or with an `xattr_name`, list[tuple[bytes, int, int] |
///         None]: per block, the attribute's value (b"" if none) and the
///         file's st_dev and st_ino; None for a failed block.
/// @note Releases the GIL for the entire batch. A block's own failure
///       (is_block_error) does not stop the batch; any other error does, and
///       the blocks after it count as failed, untried. If any failed, raises
///       the error that stopped it, else the first, with `failed_indices`, the
///       indices of all failed blocks, `untried`, those after a stop, with an
///       `xattr_name`, `xattr_reads`, the list returned otherwise, and with
///       `checksum`, `integrity_failed`, the indices of the blocks that failed
///       their CRC32C.
static PyObject* batch_load_block(PyObject* /*self*/, PyObject* args) {
  PyObject* source_paths_obj = nullptr;
  PyObject* buffers_obj = nullptr;
  int use_o_direct = 1;
  const char* xattr_name = nullptr;
  int checksum = 0;

  if (!PyArg_ParseTuple(args, "O!O!|pzp", &PyList_Type, &source_paths_obj,
                        &PyList_Type, &buffers_obj, &use_o_direct, &xattr_name,
                        &checksum)) {
    return nullptr;
  }

  const Py_ssize_t n = PyList_Size(source_paths_obj);
  if (PyList_Size(buffers_obj) != n) {
    PyErr_SetString(PyExc_ValueError,
                    "source_paths and buffers must have the same length");
    return nullptr;
  }

  std::vector<const char*> source_paths(n);
  if (!extract_str_list(source_paths_obj, n, source_paths)) return nullptr;

  std::vector<Py_buffer> buffers(n);
  if (!extract_buffer_list(buffers_obj, n, PyBUF_WRITABLE, buffers)) {
    return nullptr;
  }

  // A block's own failure does not stop the batch: the others are still
  // loaded. Reserved here: no allocation (bad_alloc) without the GIL.
  std::vector<Py_ssize_t> failed_indices;
  failed_indices.reserve(n);
  std::vector<Py_ssize_t> checksum_failed_indices;
  checksum_failed_indices.reserve(checksum ? n : 0);
  std::vector<char> failed(n, 0);
  std::vector<FileXattr> xattrs(xattr_name != nullptr ? n : 0);
  Py_ssize_t failure_index = -1;  // the error raised
  Py_ssize_t untried_from = n;
  int failure_errno = 0;

  {
    Py_BEGIN_ALLOW_THREADS for (Py_ssize_t i = 0; i < n; i++) {
      char* buf = static_cast<char*>(buffers[i].buf);
      bool checksum_failed = false;
      const int err =
          _load_block(source_paths[i], buf, static_cast<size_t>(buffers[i].len),
                      use_o_direct, xattr_name,
                      xattr_name != nullptr ? &xattrs[i] : nullptr, checksum,
                      &checksum_failed);
      if (checksum_failed) {
        checksum_failed_indices.push_back(i);
      }
      if (err != 0) {
        if (failure_index < 0 || !is_block_error(err)) {
          failure_index = i;
          failure_errno = err;
        }
        failed_indices.push_back(i);
        failed[i] = 1;
        if (!is_block_error(err)) {
          untried_from = i + 1;
          for (Py_ssize_t j = i + 1; j < n; j++) {
            failed_indices.push_back(j);  // not tried
            failed[j] = 1;
          }
          break;
        }
      }
    }
    Py_END_ALLOW_THREADS
  }

  release_buffer_list(buffers);

  PyObject* xattr_reads = nullptr;
  if (xattr_name != nullptr) {
    xattr_reads = PyList_New(n);
    if (xattr_reads == nullptr) {
      return nullptr;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
      PyObject* item;
      if (failed[i]) {
        item = Py_NewRef(Py_None);
      } else {
        PyObject* value = PyBytes_FromStringAndSize(
            reinterpret_cast<const char*>(xattrs[i].value),
            static_cast<Py_ssize_t>(xattrs[i].len));
        item =
            value == nullptr
                ? nullptr
                : Py_BuildValue("(NKK)", value,
                                static_cast<unsigned long long>(xattrs[i].dev),
                                static_cast<unsigned long long>(xattrs[i].ino));
        if (item == nullptr) {
          Py_DECREF(xattr_reads);
          return nullptr;
        }
      }
      PyList_SetItem(xattr_reads, i, item);
    }
  }

  if (!failed_indices.empty()) {
    // PyErr_SetFromErrnoWithFilename() reads the errno to format exception.
    errno = failure_errno;
    PyErr_SetFromErrnoWithFilename(PyExc_OSError, source_paths[failure_index]);
    // Attach the indices of all failed blocks so the tier can keep every
    // block that loaded (partial success).
    PyObject *etype, *evalue, *etb;
    PyErr_Fetch(&etype, &evalue, &etb);
    PyErr_NormalizeException(&etype, &evalue, &etb);
    if (evalue != nullptr) {
      // Without the attribute (out of memory), every block counts as failed.
      PyObject* indices =
          index_list(failed_indices.data(), failed_indices.size());
      if (indices != nullptr) {
        PyObject_SetAttrString(evalue, "failed_indices", indices);
        Py_DECREF(indices);
      }
      // the blocks after a stop: the last of failed_indices
      PyObject* untried = index_list(
          failed_indices.data() + failed_indices.size() - (n - untried_from),
          static_cast<size_t>(n - untried_from));
      if (untried != nullptr) {
        PyObject_SetAttrString(evalue, "untried", untried);
        Py_DECREF(untried);
      }
      if (checksum) {
        PyObject* checksum_indices = index_list(checksum_failed_indices.data(),
                                                checksum_failed_indices.size());
        if (checksum_indices != nullptr) {
          PyObject_SetAttrString(evalue, "integrity_failed", checksum_indices);
          Py_DECREF(checksum_indices);
        }
      }
      if (xattr_reads != nullptr) {
        PyObject_SetAttrString(evalue, "xattr_reads", xattr_reads);
      }
    }
    Py_XDECREF(xattr_reads);
    PyErr_Restore(etype, evalue, etb);
    return nullptr;
  }

  if (xattr_reads != nullptr) {
    return xattr_reads;
  }
  Py_RETURN_NONE;
}

static PyMethodDef fs_io_C_methods[] = {
    {"batch_lookup", batch_lookup, METH_VARARGS,
     "batch_lookup(paths: list[str]) -> list[bool]\n"
     "\n"
     "Check file existence for a batch of paths (a symbolic link counts as "
     "missing)."},
    {"batch_store_block", batch_store_block, METH_VARARGS,
     "batch_store_block(tmp_paths: list[str], dest_paths: list[str],\n"
     "                  buffers: list[bytes-like],\n"
     "                  use_o_direct: bool = True,\n"
     "                  file_mode: int = 0o600,\n"
     "                  dir_mode: int = 0o700,\n"
     "                  xattr_name: str | None = None,\n"
     "                  xattr_values: list[bytes-like] = ...,\n"
     "                  checksum: bool = False) -> None\n"
     "\n"
     "Store a batch of blocks, each from its own buffer, to disk; with "
     "checksum, each with its CRC32C in the user.vllm.kv_crc32c xattr. A "
     "block's own failure does not stop the batch, any other error does; if "
     "any failed, raises the error that stopped it, else the first."},
    {"batch_load_block", batch_load_block, METH_VARARGS,
     "batch_load_block(source_paths: list[str],\n"
     "                 buffers: list[writable bytes-like],\n"
     "                 use_o_direct: bool = True,\n"
     "                 xattr_name: str | None = None,\n"
     "                 checksum: bool = False)\n"
     "    -> None | list[tuple[bytes, int, int] | None]\n"
     "\n"
     "Load a batch of blocks from disk into corresponding buffers; with an "
     "xattr_name, return its value per block, read through the same fd, "
     "with the file's st_dev and st_ino; with checksum, check each block "
     "against its CRC32C (user.vllm.kv_crc32c). A block's own failure "
     "(missing, not a whole block) does not stop the batch, any other error "
     "does; if any failed, raises the error that stopped it, else the first, "
     "with failed_indices, untried (and xattr_reads, integrity_failed) set."},
    {nullptr, nullptr, 0, nullptr},
};

static struct PyModuleDef fs_io_C_module = {
    PyModuleDef_HEAD_INIT, "fs_io_C", "Filesystem helpers for KV offload", -1,
    fs_io_C_methods,
};

PyMODINIT_FUNC PyInit_fs_io_C(void) { return PyModule_Create(&fs_io_C_module); }

}  // extern "C"
