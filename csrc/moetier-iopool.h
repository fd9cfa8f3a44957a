#pragma once

// Expert reads off the compute threads, as task states the cache claims, waits for or cancels, and
// two FIFOs (urgent: the on-demand reads of the layer being computed; then prefetches). Two ways to
// run them: a few I/O threads that sleep on a condition variable (the compute threads spin at their
// barriers; on 2 cores a spinning I/O thread would steal their time), or an io_uring with no thread
// at all. Knows nothing of ggml; the read itself is a callback (moetier_model wires it to moetier-read).

#include "moetier-io.h"
#include "moetier-uring.h"

#include <sys/uio.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

enum moetier_io_state : int32_t {
    MOETIER_IO_FREE    = 0,  // entry unused
    MOETIER_IO_QUEUED  = 1,
    MOETIER_IO_RUNNING = 2,
    MOETIER_IO_DONE    = 3,
    MOETIER_IO_FAILED  = 4,
};

// what to read: opaque to the pool, interpreted by the read callbacks
struct moetier_io_task {
    const void *            layer      = nullptr;  // the served layer (moetier_layer)
    int32_t                 prec       = 0;
    int32_t                 expert     = 0;
    int32_t                 slot       = 0;
    int32_t                 proj       = -1;  // one projection, -1 = every projection of the expert
    // if set, the read callback adds the bytes it read (prefetch accounting)
    std::atomic<uint64_t> * bytes_done = nullptr;
    int64_t                 t_start_us = 0;                // io_uring mode: when the read was handed to the kernel
    int32_t                 state      = MOETIER_IO_FREE;  // guarded by the pool mutex
};

// one O_DIRECT read of a task (io_uring mode)
struct moetier_io_part {
    int      fd     = -1;
    uint64_t offset = 0;
    size_t   bytes  = 0;  // asked for
    size_t   need   = 0;  // at least this many must come back (a last block past EOF reads short)
    unsigned n_iov  = 0;
    iovec    iov[8] = {};
};

static constexpr unsigned MOETIER_IO_MAX_PARTS = 4;

// a task as O_DIRECT reads (io_uring mode): a store's expert is one vectored read straight into its
// slots; a GGUF's projections lie in separate tensors at unaligned offsets, so each is one read of
// the blocks around it into the task's staging buffer, copied into the slots when all are in
struct moetier_io_vec_read {
    unsigned        n_parts = 0;
    moetier_io_part parts[MOETIER_IO_MAX_PARTS];
    uint8_t *       stage = nullptr;  // the task's staging buffer, nullptr if the pool has none
};

class moetier_io_pool {
  public:
    // reads task into its slot; false + err on failure. Called on an I/O thread with its own bounce id.
    using read_fn = std::function<bool(const moetier_io_task & task, int thread_id, std::string & err)>;
    // io_uring mode: describes task as its reads (false + err if it cannot be), then moves what was
    // read into place (from the staging buffer)
    using prep_fn = std::function<bool(const moetier_io_task & task, moetier_io_vec_read & rd, std::string & err)>;
    using finish_fn =
        std::function<bool(const moetier_io_task & task, const moetier_io_vec_read & rd, std::string & err)>;

    // n_threads I/O threads that sleep when idle
    moetier_io_pool(int n_threads, size_t capacity, read_fn fn);
    // no threads: the kernel reads (ring); every urgent task is in flight at once (with staging
    // buffers, as many as there are buffers; urgent ones take them first), prefetches up to
    // depth_prefetch. Calls must come from one thread at a time (the compute thread that runs the
    // cache's serial ops); they also collect completions. With n_stage > 0, each task in flight
    // holds one of n_stage staging buffers of stage_bytes (4096-aligned; throws std::bad_alloc), and
    // no more tasks than that are in flight.
    moetier_io_pool(std::unique_ptr<moetier_uring> ring,
                    int                            depth_prefetch,
                    size_t                         capacity,
                    prep_fn                        prep,
                    finish_fn                      finish,
                    int                            n_stage     = 0,
                    size_t                         stage_bytes = 0);
    ~moetier_io_pool();

    // io_uring mode: no threads to hand work to; one caller waits for everything
    bool uses_uring() const { return ring != nullptr; }

    moetier_io_pool(const moetier_io_pool &)             = delete;
    moetier_io_pool & operator=(const moetier_io_pool &) = delete;

    int n_threads() const { return ring ? 1 : (int) threads.size(); }

    // how many prefetches read at once: the ring's prefetch depth, or one per I/O thread
    int prefetch_depth() const { return ring ? depth_pf : (int) threads.size(); }

    // prefetches queued and not started yet: more than none when a walk starts means the disk is
    // behind the reads already asked of it
    int queued_prefetches();

    // queues a read; returns its task id, or -1 if every entry is in use. Urgent reads go before
    // every prefetch, in the order they were submitted.
    int32_t submit(const moetier_io_task & task, bool is_urgent = false);

    // the state of task id
    int32_t state(int32_t id);

    // whether task id's read ended well, without the mutex (which a waiting thread holds while it
    // blocks on the ring): another thread checks what has landed meanwhile. The flag stays until the
    // id is submitted again, so it may be read after the id was released only while nothing can
    // submit (the cache's load op: no read is submitted there).
    bool landed(int32_t id) const noexcept { return landed_[id].load(std::memory_order_acquire) != 0; }

    // if the task is still queued, removes it and frees the entry (returns true): the caller reads
    // it itself or drops it; otherwise leaves it alone (returns false)
    bool claim(int32_t id);

    // blocks until the task is no longer queued or running; returns DONE or FAILED (FREE if it was
    // claimed or released meanwhile)
    int32_t wait(int32_t id);

    // frees a DONE or FAILED entry
    void release(int32_t id);

    // first read error of a task, "" if none
    std::string error();

  private:
    void worker(int thread_id);

    // io_uring mode, with the mutex held: start queued tasks while there is room; collect
    // completions (block: wait for at least one if any read is in flight)
    void pump();
    void reap(bool block);
    // io_uring mode, mutex held: a task in flight ended (its parts all in, or not taken by the kernel)
    // a read that ended gives its place in flight back (the depth prefetch may use)
    void end_flight(int32_t id);
    // a task is done or failed; in_flight: it still holds its place (else end_flight ran)
    void end_task(int32_t id, bool ok, const std::string & err, bool in_flight = true);

    read_fn fn;

    std::unique_ptr<moetier_uring>      ring;
    prep_fn                             prep;
    finish_fn                           finish;
    std::vector<moetier_io_vec_read>    reads;       // [capacity] io_uring reads (their iovecs live here)
    std::vector<uint8_t>                is_urgent_;  // [capacity]
    std::vector<uint8_t>                pending;     // [capacity] parts of a task still being read
    std::vector<uint8_t>                part_bad;    // [capacity] a part of it failed
    std::vector<moetier_aligned_buffer> stages;      // staging buffers
    std::vector<int32_t>                free_stages;
    std::vector<int32_t>                stage_of;    // [capacity] the staging buffer a task holds, -1 none
    std::vector<int32_t>                round;       // scratch of pump: ids prepared in this call
    std::vector<int32_t>                checking;    // scratch of reap: reads that ended, to finish
    int                                 depth_pf    = 1;
    int                                 n_flight    = 0;
    int                                 n_flight_pf = 0;

    std::mutex                              mu;
    std::condition_variable                 cv_work;
    std::condition_variable                 cv_done;
    std::deque<int32_t>                     queue;   // prefetches
    std::deque<int32_t>                     urgent;  // on-demand reads
    std::vector<moetier_io_task>            tasks;
    std::vector<int32_t>                    free_ids;
    std::unique_ptr<std::atomic<uint8_t>[]> landed_;  // [capacity] 1 once the task is DONE
    std::string                             error_msg;
    bool                                    stop = false;

    std::vector<std::thread> threads;
};
