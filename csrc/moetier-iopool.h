#pragma once

// Background expert reads for prefetch: a few I/O threads that sleep on a condition variable (the
// compute threads spin at their barriers; on 2 cores a spinning I/O thread would steal their time),
// a FIFO of read tasks, and the task states the cache's resolve claims, waits for or cancels.
// Knows nothing of ggml; the read itself is a callback into the cache.

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

enum moetier_io_state : int32_t {
    MOETIER_IO_FREE    = 0, // entry unused
    MOETIER_IO_QUEUED  = 1,
    MOETIER_IO_RUNNING = 2,
    MOETIER_IO_DONE    = 3,
    MOETIER_IO_FAILED  = 4,
};

// what to read: opaque to the pool, interpreted by the read callback
struct moetier_io_task {
    void *  owner  = nullptr; // the cache
    void *  layer  = nullptr;
    int32_t prec   = 0;
    int32_t expert = 0;
    int32_t slot   = 0;
    int32_t state  = MOETIER_IO_FREE; // guarded by the pool mutex
};

class moetier_io_pool {
public:
    // reads task into its slot; false + err on failure. Called on an I/O thread with its own bounce id.
    using read_fn = std::function<bool(const moetier_io_task & task, int thread_id, std::string & err)>;

    moetier_io_pool(int n_threads, size_t capacity, read_fn fn);
    ~moetier_io_pool();

    moetier_io_pool(const moetier_io_pool &) = delete;
    moetier_io_pool & operator=(const moetier_io_pool &) = delete;

    int n_threads() const { return (int) threads.size(); }

    // queues a read; returns its task id, or -1 if every entry is in use
    int32_t submit(const moetier_io_task & task);

    // the state of task id
    int32_t state(int32_t id);

    // if the task is still queued, removes it and frees the entry (returns true): the caller reads
    // it itself or drops it; otherwise leaves it alone (returns false)
    bool claim(int32_t id);

    // blocks until the task is no longer queued or running; returns DONE or FAILED
    int32_t wait(int32_t id);

    // frees a DONE or FAILED entry
    void release(int32_t id);

    // first read error of a task, "" if none
    std::string error();

private:
    void worker(int thread_id);

    read_fn fn;

    std::mutex                   mu;
    std::condition_variable      cv_work;
    std::condition_variable      cv_done;
    std::deque<int32_t>          queue;
    std::vector<moetier_io_task> tasks;
    std::vector<int32_t>         free_ids;
    std::string                  error_msg;
    bool                         stop = false;

    std::vector<std::thread>     threads;
};
