#pragma once

// How experts are read: files opened for O_DIRECT (buffered fallback), aligned buffers, pread.
// Knows nothing of ggml graphs or the cache.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

// Read latencies in power-of-two buckets (moetier_read_hist): bucket i holds reads of at most
// 32 << i microseconds (the last one: any). Added from any thread.
struct moetier_latency_hist {
    static constexpr int n_buckets = 16;

    std::atomic<uint64_t> count[n_buckets] = {};
    std::atomic<uint64_t> n{ 0 };
    std::atomic<uint64_t> sum_us{ 0 };

    static uint64_t le_us(int i) { return i + 1 < n_buckets ? (uint64_t) 32 << i : UINT64_MAX; }

    void add(int64_t us);
    void reset();
};

// Fault injection for tests (tests/test_io_faults.py), off unless configured: MOETIER_FAULTS, read
// at every model load, as KIND:N[,KIND:N...] makes every N-th expert read of that kind fail:
//   eio    the read returns EIO (pread and preadv, an io_uring completion)
//   short  the read returns fewer bytes than asked (the reader must finish or fail it)
//   flip   one byte of what was read is flipped before the checksum is checked (silent corruption)
// N > 1 is a transient fault: a read at a file offset that already had one (of any kind) reads right (a retry
// passes); N = 1 is a persistent one: every read fails, retries too.
//   nodirect  opening an expert file with O_DIRECT is refused (as some filesystems do): buffered reads
//   slow      a read on an I/O thread (prefetch, warm start) starts 5 ms late: a device that is behind
//             the reads asked of it (every N-th one, whatever its offset)
enum moetier_fault_kind {
    MOETIER_FAULT_EIO,
    MOETIER_FAULT_SHORT,
    MOETIER_FAULT_FLIP,
    MOETIER_FAULT_NODIRECT,
    MOETIER_FAULT_SLOW,
    MOETIER_FAULT_COUNT
};

// parses spec (MOETIER_FAULTS) and resets the counters; false + err on a malformed spec
bool     moetier_faults_configure(const char * spec, std::string & err);
// whether this read (at file offset off) gets a fault of kind k (counts the reads of each kind)
bool     moetier_fault(moetier_fault_kind k, uint64_t off);
// a slow fault (moetier_fault(MOETIER_FAULT_SLOW, ...) said so): sleeps as a busy device would
void     moetier_fault_delay(bool slow);
// faults injected since the last configure
uint64_t moetier_faults_injected();

// one destination of a vectored read
struct moetier_iovec {
    void * base = nullptr;
    size_t len  = 0;
};

struct moetier_aligned_deleter {
    void operator()(void * p) const;
};

// page-aligned heap buffer, as O_DIRECT needs for its destination
struct moetier_aligned_buffer {
    std::unique_ptr<void, moetier_aligned_deleter> data;
    size_t                                         size = 0;

    // throws std::bad_alloc
    void reserve(size_t n);
};

// Anonymous memory mapped for the expert cache's pools: reserved, not committed (MAP_NORESERVE),
// so a pool may reserve room to grow into while only the pages its slots wrote count; page-aligned,
// as O_DIRECT needs for its destination.
class moetier_mapped_memory {
  public:
    moetier_mapped_memory() = default;
    ~moetier_mapped_memory();
    moetier_mapped_memory(const moetier_mapped_memory &)             = delete;
    moetier_mapped_memory & operator=(const moetier_mapped_memory &) = delete;

    // maps n bytes (rounded up to pages), unmapping what was mapped before. throws std::bad_alloc
    void map(size_t n);

    // gives the pages of [off, off + n) back to the system (they read as zeros after)
    void release(size_t off, size_t n) noexcept;

    // asks for transparent huge pages (MADV_HUGEPAGE): faulted in 2 MiB at a time, and fewer TLB
    // misses when the CPU reads them. false if the kernel refused (no THP support)
    bool advise_huge() noexcept;

    // commits the pages of [off, off + n) (zeroed by the kernel, as a first write would) without
    // writing them: safe while another thread writes there. false if the kernel cannot (before Linux
    // 5.14) or refused (out of memory)
    bool populate(size_t off, size_t n) noexcept;

    void * data() const { return base; }

    size_t size() const { return len; }

  private:
    void * base = nullptr;
    size_t len  = 0;
};

// A read-only file for expert reads. With direct I/O requested and accepted by the file system,
// reads bypass the page cache: an expert read once must not stay resident behind the cache's back
// (that is what a memory cap counts). Otherwise reads are buffered and the pages are dropped after.
class moetier_file {
  public:
    // throws std::runtime_error naming the path
    moetier_file(const std::string & path, bool direct_io);
    ~moetier_file();

    moetier_file(const moetier_file &)             = delete;
    moetier_file & operator=(const moetier_file &) = delete;

    // Reads n bytes at offset into dst. Aligned transfers go straight into dst; others use bounce
    // (grown once to the largest transfer, never per call in steady state). Returns false and sets
    // err on failure or a short file. Thread-safe for distinct dst/bounce.
    bool read(void * dst, uint64_t offset, size_t n, moetier_aligned_buffer & bounce, std::string & err) const;

    // Reads consecutive file bytes at offset into n destinations (preadv): all must be 4096-aligned in
    // address and length for O_DIRECT. Returns false and sets err on failure or a short file.
    bool readv(const moetier_iovec * iov, int n, uint64_t offset, std::string & err) const;

    const std::string & path() const { return path_; }

    int direct_fd() const { return fd_direct_; }  // -1 if the file is read through the page cache

    uint64_t size() const { return size_; }

    bool direct() const { return direct_; }

    // this file's reads are expert reads: MOETIER_FAULTS applies to them (not to header checks)
    void set_fault_injection(bool on) { faults_ = on; }

  private:
    bool pread_full(int fd, void * dst, uint64_t offset, size_t n, std::string & err) const;

    bool fault(moetier_fault_kind k, uint64_t off) const { return faults_ && moetier_fault(k, off); }

    std::string path_;
    int         fd_        = -1;  // buffered
    int         fd_direct_ = -1;  // O_DIRECT, -1 if refused
    uint64_t    size_      = 0;
    bool        direct_    = false;
    bool        faults_    = false;
};
