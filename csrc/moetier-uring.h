#pragma once

// A minimal io_uring for expert reads (raw system calls: no liburing on the targets we build on).
// With O_DIRECT the kernel issues a read at submission and completes it by interrupt, with no thread
// of ours: reads overlap compute without taking a core from the compute threads, which spin at their
// barriers (on 2 cores an I/O thread has to preempt one of them for every read it starts or ends).
// Not thread-safe: the owner serialises calls.

#include <cstdint>
#include <string>

struct iovec;

class moetier_uring {
  public:
    // a ring of `entries` submissions; check ok(): the kernel may refuse (old, or seccomp)
    explicit moetier_uring(unsigned entries);
    ~moetier_uring();

    moetier_uring(const moetier_uring &)             = delete;
    moetier_uring & operator=(const moetier_uring &) = delete;

    bool ok() const { return fd >= 0; }

    const std::string & error() const { return err; }

    // queues a vectored read (iov must stay valid until submit()); false if the queue is full
    bool prep_readv(int file, const iovec * iov, unsigned n_iov, uint64_t offset, uint64_t user_data);

    // reads that can still be queued before submit()
    unsigned free_entries() const;

    // hands the queued reads to the kernel; with wait, also blocks until a completion is there.
    // false on an error of the ring itself (see error())
    bool submit(bool wait);

    // takes one completion; res: bytes read or -errno
    bool pop(uint64_t & user_data, int32_t & res);

    // after a failed submit(): drops the queued reads the kernel has not taken; returns how many (the
    // last ones prepared)
    unsigned rollback();

  private:
    int         fd = -1;
    std::string err;

    unsigned to_submit = 0;
    void *   sq_ring   = nullptr;
    size_t   sq_size   = 0;
    void *   cq_ring   = nullptr;
    size_t   cq_size   = 0;
    void *   sqes      = nullptr;
    size_t   sqes_size = 0;

    unsigned * sq_head    = nullptr;
    unsigned * sq_tail    = nullptr;
    unsigned * sq_mask    = nullptr;
    unsigned * sq_array   = nullptr;
    unsigned   sq_entries = 0;
    unsigned * cq_head    = nullptr;
    unsigned * cq_tail    = nullptr;
    unsigned * cq_mask    = nullptr;
    void *     cqes       = nullptr;
};
