#include "moetier-uring.h"

#include "moetier-impl.h"

#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#if defined(__linux__) && defined(__NR_io_uring_setup)
#    include <linux/io_uring.h>
#    define MOETIER_HAVE_URING 1
#endif

#ifdef MOETIER_HAVE_URING

moetier_uring::moetier_uring(unsigned entries) {
    io_uring_params p;
    memset(&p, 0, sizeof(p));
    const int ring = (int) syscall(__NR_io_uring_setup, entries, &p);
    if (ring < 0) {
        err = format("io_uring_setup: %s", strerror(errno));
        return;
    }
    sq_size           = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    cq_size           = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
    sqes_size         = p.sq_entries * sizeof(io_uring_sqe);
    const bool single = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
    if (single) {
        sq_size = cq_size = std::max(sq_size, cq_size);
    }
    sq_ring = mmap(nullptr, sq_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, ring, IORING_OFF_SQ_RING);
    cq_ring =
        sq_ring == MAP_FAILED ? MAP_FAILED :
        single                ? sq_ring :
                 mmap(nullptr, cq_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, ring, IORING_OFF_CQ_RING);
    sqes = cq_ring == MAP_FAILED ?
               MAP_FAILED :
               mmap(nullptr, sqes_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, ring, IORING_OFF_SQES);
    if (sq_ring == MAP_FAILED || cq_ring == MAP_FAILED || sqes == MAP_FAILED) {
        err = format("io_uring mmap: %s", strerror(errno));
        if (sqes != MAP_FAILED && sqes) {
            munmap(sqes, sqes_size);
        }
        if (cq_ring != MAP_FAILED && cq_ring && cq_ring != sq_ring) {
            munmap(cq_ring, cq_size);
        }
        if (sq_ring != MAP_FAILED && sq_ring) {
            munmap(sq_ring, sq_size);
        }
        sq_ring = cq_ring = sqes = nullptr;
        close(ring);
        return;
    }
    char * sq  = (char *) sq_ring;
    char * cq  = (char *) cq_ring;
    sq_head    = (unsigned *) (sq + p.sq_off.head);
    sq_tail    = (unsigned *) (sq + p.sq_off.tail);
    sq_mask    = (unsigned *) (sq + p.sq_off.ring_mask);
    sq_array   = (unsigned *) (sq + p.sq_off.array);
    sq_entries = p.sq_entries;
    cq_head    = (unsigned *) (cq + p.cq_off.head);
    cq_tail    = (unsigned *) (cq + p.cq_off.tail);
    cq_mask    = (unsigned *) (cq + p.cq_off.ring_mask);
    cqes       = cq + p.cq_off.cqes;
    fd         = ring;
}

moetier_uring::~moetier_uring() {
    if (fd < 0) {
        return;
    }
    munmap(sqes, sqes_size);
    if (cq_ring != sq_ring) {
        munmap(cq_ring, cq_size);
    }
    munmap(sq_ring, sq_size);
    close(fd);
}

bool moetier_uring::prep_readv(int file, const iovec * iov, unsigned n_iov, uint64_t offset, uint64_t user_data) {
    const unsigned head = __atomic_load_n(sq_head, __ATOMIC_ACQUIRE);
    const unsigned tail = *sq_tail;
    if (tail - head >= sq_entries) {
        return false;
    }
    const unsigned idx = tail & *sq_mask;
    io_uring_sqe * sqe = (io_uring_sqe *) sqes + idx;
    memset(sqe, 0, sizeof(*sqe));
    sqe->opcode    = IORING_OP_READV;
    sqe->fd        = file;
    sqe->addr      = (uint64_t) (uintptr_t) iov;
    sqe->len       = n_iov;
    sqe->off       = offset;
    sqe->user_data = user_data;
    sq_array[idx]  = idx;
    __atomic_store_n(sq_tail, tail + 1, __ATOMIC_RELEASE);
    ++to_submit;
    return true;
}

unsigned moetier_uring::free_entries() const {
    return sq_entries - (*sq_tail - __atomic_load_n(sq_head, __ATOMIC_ACQUIRE));
}

bool moetier_uring::submit(bool wait) {
    for (;;) {
        const unsigned flags = wait ? IORING_ENTER_GETEVENTS : 0;
        const int      n     = (int) syscall(__NR_io_uring_enter, fd, to_submit, wait ? 1 : 0, flags, nullptr, 0);
        if (n >= 0) {
            to_submit -= std::min<unsigned>(to_submit, (unsigned) n);
            if (to_submit == 0 || n == 0) {
                return true;
            }
            continue;
        }
        if (errno == EINTR) {
            continue;
        }
        err = format("io_uring_enter: %s", strerror(errno));
        return false;
    }
}

unsigned moetier_uring::rollback() {
    // no SQPOLL: the kernel reads submissions only inside io_uring_enter, so the tail can move back
    const unsigned n = to_submit;
    __atomic_store_n(sq_tail, *sq_tail - n, __ATOMIC_RELEASE);
    to_submit = 0;
    return n;
}

bool moetier_uring::pop(uint64_t & user_data, int32_t & res) {
    const unsigned head = *cq_head;
    if (head == __atomic_load_n(cq_tail, __ATOMIC_ACQUIRE)) {
        return false;
    }
    const io_uring_cqe * cqe = (const io_uring_cqe *) cqes + (head & *cq_mask);
    user_data                = cqe->user_data;
    res                      = cqe->res;
    __atomic_store_n(cq_head, head + 1, __ATOMIC_RELEASE);
    return true;
}

#else

moetier_uring::moetier_uring(unsigned entries) : err("io_uring is not available on this platform") {
    (void) entries;
}

moetier_uring::~moetier_uring() = default;

bool moetier_uring::prep_readv(int, const iovec *, unsigned, uint64_t, uint64_t) {
    return false;
}

unsigned moetier_uring::free_entries() const {
    return 0;
}

bool moetier_uring::submit(bool) {
    return false;
}

bool moetier_uring::pop(uint64_t &, int32_t &) {
    return false;
}

unsigned moetier_uring::rollback() {
    return 0;
}

#endif
