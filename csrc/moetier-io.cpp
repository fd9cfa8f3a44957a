#include "moetier-io.h"

#include "moetier-impl.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <stdexcept>
#include <thread>
#include <unordered_set>

void moetier_aligned_deleter::operator()(void * p) const {
    free(p);
}

void moetier_aligned_buffer::reserve(size_t n) {
    if (n <= size) {
        return;
    }
    n        = moetier_align_up(n);
    void * p = nullptr;
    if (posix_memalign(&p, MOETIER_ALIGN, n) != 0) {
        throw std::bad_alloc();
    }
    data.reset(p);
    size = n;
}

moetier_mapped_memory::~moetier_mapped_memory() {
    if (base != nullptr) {
        munmap(base, len);
    }
}

void moetier_mapped_memory::map(size_t n) {
    if (base != nullptr) {
        munmap(base, len);
        base = nullptr;
        len  = 0;
    }
    if (n == 0) {
        return;
    }
    n        = moetier_align_up(n);
    void * p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
        throw std::bad_alloc();
    }
    base = p;
    len  = n;
}

bool moetier_mapped_memory::advise_huge() noexcept {
#ifdef MADV_HUGEPAGE
    return base != nullptr && madvise(base, len, MADV_HUGEPAGE) == 0;
#else
    return false;
#endif
}

void moetier_mapped_memory::release(size_t off, size_t n) noexcept {
    if (base == nullptr || off >= len) {
        return;
    }
    // whole pages only: a slot's stride is 4096-aligned, so on 4 KiB pages its pages are its own (on
    // larger pages only the pages wholly inside it go back)
    static const size_t page = (size_t) sysconf(_SC_PAGESIZE);
    const size_t        a    = moetier_align_up(off, page);
    const size_t        b    = std::min(len, off + n) / page * page;
    if (b > a) {
        madvise((char *) base + a, b - a, MADV_DONTNEED);
    }
}

bool moetier_mapped_memory::populate(size_t off, size_t n) noexcept {
#ifdef __linux__
#    ifndef MADV_POPULATE_WRITE
#        define MADV_POPULATE_WRITE 23
#    endif
    static const size_t page = (size_t) sysconf(_SC_PAGESIZE);
    if (base == nullptr || off >= len) {
        return false;
    }
    const size_t a = off / page * page;
    const size_t b = std::min(len, moetier_align_up(off + n, page));
    return madvise((char *) base + a, b - a, MADV_POPULATE_WRITE) == 0;
#else
    (void) off;
    (void) n;
    return false;
#endif
}

moetier_file::moetier_file(const std::string & path, bool direct_io) : path_(path) {
    fd_ = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) {
        throw std::runtime_error(format("%s: cannot open: %s", path.c_str(), strerror(errno)));
    }
    struct stat st;
    if (fstat(fd_, &st) != 0) {
        const int e = errno;
        close(fd_);
        throw std::runtime_error(format("%s: cannot stat: %s", path.c_str(), strerror(e)));
    }
    size_ = (uint64_t) st.st_size;
    if (direct_io) {
#ifdef O_DIRECT
        // refused (e.g. tmpfs): buffered reads; the owner says so (moetier_model::warn), once per model
        fd_direct_ =
            moetier_fault(MOETIER_FAULT_NODIRECT, 0) ? -1 : open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
#endif
    }
    direct_ = fd_direct_ >= 0;
}

//
// fault injection
//

namespace {

struct moetier_faults {
    std::atomic<uint64_t>        every[MOETIER_FAULT_COUNT] = {};  // 0 = off
    std::atomic<uint64_t>        seen[MOETIER_FAULT_COUNT]  = {};
    std::atomic<uint64_t>        injected{ 0 };
    std::mutex                   mu;
    std::unordered_set<uint64_t> hit;  // offsets that had a transient fault (of any kind)
};

moetier_faults g_faults;

}  // namespace

bool moetier_faults_configure(const char * spec, std::string & err) {
    uint64_t                  every[MOETIER_FAULT_COUNT] = {};
    const std::string         s                          = spec ? spec : "";
    static const char * const names[]                    = { "eio", "short", "flip", "nodirect", "slow" };
    size_t                    pos                        = 0;
    while (!s.empty() && pos <= s.size()) {  // every item, an empty one (a stray comma) too
        size_t end              = s.find(',', pos);
        end                     = end == std::string::npos ? s.size() : end;
        const std::string item  = s.substr(pos, end - pos);
        const size_t      colon = item.find(':');
        int               k     = -1;
        for (int i = 0; i < MOETIER_FAULT_COUNT; ++i) {
            if (colon != std::string::npos && item.compare(0, colon, names[i]) == 0 && colon == strlen(names[i])) {
                k = i;
            }
        }
        char *                   tail = nullptr;
        const unsigned long long n    = k >= 0 ? strtoull(item.c_str() + colon + 1, &tail, 10) : 0;
        if (k < 0 || n == 0 || !tail || *tail != '\0') {
            err = format("MOETIER_FAULTS: '%s' is not KIND:N with KIND eio, short, flip, nodirect or slow and N >= 1",
                         item.c_str());
            return false;
        }
        every[k] = n;
        pos      = end + 1;
    }
    std::lock_guard<std::mutex> lock(g_faults.mu);
    for (int i = 0; i < MOETIER_FAULT_COUNT; ++i) {
        g_faults.every[i].store(every[i]);
        g_faults.seen[i].store(0);
    }
    g_faults.hit.clear();
    g_faults.injected.store(0);
    return true;
}

bool moetier_fault(moetier_fault_kind k, uint64_t off) {
    const uint64_t every = g_faults.every[k].load(std::memory_order_relaxed);
    if (every == 0) {
        return false;
    }
    if (k == MOETIER_FAULT_SLOW) {
        if (g_faults.seen[k].fetch_add(1, std::memory_order_relaxed) % every != every - 1) {
            return false;
        }
    } else if (every > 1) {
        std::lock_guard<std::mutex> lock(g_faults.mu);
        if (g_faults.hit.count(off) || ++g_faults.seen[k] % every != 0) {
            return false;
        }
        g_faults.hit.insert(off);
    }
    g_faults.injected.fetch_add(1, std::memory_order_relaxed);
    return true;
}

void moetier_fault_delay(bool slow) {
    if (slow) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
}

uint64_t moetier_faults_injected() {
    return g_faults.injected.load();
}

moetier_file::~moetier_file() {
    if (fd_direct_ >= 0) {
        close(fd_direct_);
    }
    if (fd_ >= 0) {
        close(fd_);
    }
}

bool moetier_file::pread_full(int fd, void * dst, uint64_t offset, size_t n, std::string & err) const {
    uint8_t * p    = (uint8_t *) dst;
    size_t    done = 0;
    while (done < n) {
        size_t want = n - done;
        if (want > 2 * MOETIER_ALIGN && fault(MOETIER_FAULT_SHORT, offset + done)) {
            want = want / 2 / MOETIER_ALIGN * MOETIER_ALIGN;  // stays block aligned for O_DIRECT
        }
        ssize_t r = pread(fd, p + done, want, (off_t) (offset + done));
        if (r >= 0 && fault(MOETIER_FAULT_EIO, offset + done)) {
            r     = -1;
            errno = EIO;
        }
        if (r < 0) {
            if (errno == EINTR) {
                continue;
            }
            err = format("%s: read of %zu bytes at offset %llu failed: %s", path_.c_str(), n,
                         (unsigned long long) offset, strerror(errno));
            return false;
        }
        if (r == 0) {
            break;
        }
        done += (size_t) r;
    }
    if (done < n) {
        err = format("%s: file is truncated: wanted %zu bytes at offset %llu, file has %llu bytes", path_.c_str(), n,
                     (unsigned long long) offset, (unsigned long long) size_);
        return false;
    }
    return true;
}

bool moetier_file::read(void *                   dst,
                        uint64_t                 offset,
                        size_t                   n,
                        moetier_aligned_buffer & bounce,
                        std::string &            err) const {
    if (offset + n > size_) {
        err = format("%s: file is truncated: wanted %zu bytes at offset %llu, file has %llu bytes", path_.c_str(), n,
                     (unsigned long long) offset, (unsigned long long) size_);
        return false;
    }
    if (!direct_) {
        if (!pread_full(fd_, dst, offset, n, err)) {
            return false;
        }
#ifdef POSIX_FADV_DONTNEED
        posix_fadvise(fd_, (off_t) offset, (off_t) n, POSIX_FADV_DONTNEED);
#endif
        return true;
    }

    // O_DIRECT: transfers must be block aligned in address, offset and length; the tail of the last
    // block may lie past EOF, where pread returns short, which is fine as long as [offset, offset+n) came
    const bool aligned =
        ((uintptr_t) dst % MOETIER_ALIGN) == 0 && offset % MOETIER_ALIGN == 0 && n % MOETIER_ALIGN == 0;
    if (aligned) {
        return pread_full(fd_direct_, dst, offset, n, err);
    }

    const uint64_t a_begin = offset / MOETIER_ALIGN * MOETIER_ALIGN;
    const uint64_t a_end   = moetier_align_up(offset + n);
    const size_t   chunk   = bounce.size;
    GGML_ASSERT(chunk >= 2 * MOETIER_ALIGN);

    uint8_t * out = (uint8_t *) dst;
    for (uint64_t pos = a_begin; pos < a_end; pos += chunk) {
        const size_t   want = (size_t) std::min<uint64_t>(chunk, a_end - pos);
        // bytes of [offset, offset+n) inside [pos, pos+want)
        const uint64_t lo   = std::max<uint64_t>(pos, offset);
        const uint64_t hi   = std::min<uint64_t>(pos + want, offset + n);
        size_t         got  = 0;
        while (got < want) {
            size_t len = want - got;
            if (len > 2 * MOETIER_ALIGN && fault(MOETIER_FAULT_SHORT, pos + got)) {
                len = len / 2 / MOETIER_ALIGN * MOETIER_ALIGN;  // stays block aligned
            }
            ssize_t r = pread(fd_direct_, (uint8_t *) bounce.data.get() + got, len, (off_t) (pos + got));
            if (r >= 0 && fault(MOETIER_FAULT_EIO, pos + got)) {
                r     = -1;
                errno = EIO;
            }
            if (r < 0) {
                if (errno == EINTR) {
                    continue;
                }
                err = format("%s: read of %zu bytes at offset %llu failed: %s", path_.c_str(), want,
                             (unsigned long long) (pos + got), strerror(errno));
                return false;
            }
            if (r == 0) {
                break;
            }
            got += (size_t) r;
        }
        if (pos + got < hi) {
            err = format("%s: file is truncated at offset %llu", path_.c_str(), (unsigned long long) (pos + got));
            return false;
        }
        memcpy(out + (lo - offset), (uint8_t *) bounce.data.get() + (lo - pos), hi - lo);
    }
    return true;
}

bool moetier_file::readv(const moetier_iovec * iov, int n, uint64_t offset, std::string & err) const {
    GGML_ASSERT(n > 0 && n <= 8);
    struct iovec v[8];
    size_t       total = 0;
    for (int i = 0; i < n; ++i) {
        v[i].iov_base = iov[i].base;
        v[i].iov_len  = iov[i].len;
        total += iov[i].len;
    }
    if (offset + total > size_) {
        err = format("%s: file is truncated: wanted %zu bytes at offset %llu, file has %llu bytes", path_.c_str(),
                     total, (unsigned long long) offset, (unsigned long long) size_);
        return false;
    }
    const int fd = direct_ ? fd_direct_ : fd_;
    ssize_t   r;
    do {
        r = preadv(fd, v, n, (off_t) offset);
    } while (r < 0 && errno == EINTR);
    if (r >= 0 && fault(MOETIER_FAULT_EIO, offset)) {
        r     = -1;
        errno = EIO;
    } else if (r == (ssize_t) total && total > MOETIER_ALIGN && fault(MOETIER_FAULT_SHORT, offset)) {
        r = (ssize_t) MOETIER_ALIGN;
    }
    if (r == (ssize_t) total) {
        if (!direct_) {
#ifdef POSIX_FADV_DONTNEED
            posix_fadvise(fd_, (off_t) offset, (off_t) total, POSIX_FADV_DONTNEED);
#endif
        }
        return true;
    }
    if (r < 0) {
        err = format("%s: read of %zu bytes at offset %llu failed: %s", path_.c_str(), total,
                     (unsigned long long) offset, strerror(errno));
        return false;
    }
    // short read: finish destination by destination
    uint64_t pos = offset;
    for (int i = 0; i < n; ++i) {
        if (!pread_full(fd, iov[i].base, pos, iov[i].len, err)) {
            return false;
        }
        pos += iov[i].len;
    }
    return true;
}

void moetier_latency_hist::add(int64_t us) {
    const uint64_t u = us > 0 ? (uint64_t) us : 0;
    int            i = 0;
    while (i + 1 < n_buckets && u > le_us(i)) {
        ++i;
    }
    count[i].fetch_add(1, std::memory_order_relaxed);
    n.fetch_add(1, std::memory_order_relaxed);
    sum_us.fetch_add(u, std::memory_order_relaxed);
}

void moetier_latency_hist::reset() {
    for (auto & c : count) {
        c.store(0, std::memory_order_relaxed);
    }
    n.store(0, std::memory_order_relaxed);
    sum_us.store(0, std::memory_order_relaxed);
}
