# A pool of worker threads that run tasks: C functions with the GIL released from start to
# finish (gathers, checksums), and Python callables (a read that calls several kernels).
#
# Python threads enter TaskPool.work(), drop the GIL and loop in C: take a task from a ring,
# run it, mark it done. A compiled task never touches a Python object; a Python task (Call)
# takes the GIL for its callable only. A thread that waits for a task nobody has started yet
# runs it itself ("caller runs"); a thread whose task is running elsewhere sleeps until it is
# done, and never starts another task (tasks queued behind it belong to later steps). The
# submitter keeps every object a compiled task points into alive until it has waited for it;
# a Call keeps itself alive while it is queued or running.

from libc.stdint cimport int64_t

ctypedef int (*zb_task_fn)(void *arg) noexcept nogil

cdef enum:
    ZB_TASK_QUEUED = 0
    ZB_TASK_RUNNING = 1
    ZB_TASK_DONE = 2

cdef struct zb_task:
    zb_task_fn fn      # the work; returns a zb_status code
    void *arg          # its argument (owned by the submitter)
    int status         # set by whoever ran it; ZB_E_CANCELLED when it was dropped
    int state          # ZB_TASK_*, read and written under the pool's mutex

cdef extern from "<pthread.h>" nogil:
    ctypedef struct pthread_mutex_t:
        pass
    ctypedef struct pthread_cond_t:
        pass
    int pthread_mutex_init(pthread_mutex_t *m, void *attr)
    int pthread_mutex_destroy(pthread_mutex_t *m)
    int pthread_mutex_lock(pthread_mutex_t *m)
    int pthread_mutex_unlock(pthread_mutex_t *m)
    int pthread_cond_init(pthread_cond_t *c, void *attr)
    int pthread_cond_destroy(pthread_cond_t *c)
    int pthread_cond_wait(pthread_cond_t *c, pthread_mutex_t *m)
    int pthread_cond_signal(pthread_cond_t *c)
    int pthread_cond_broadcast(pthread_cond_t *c)

cdef class TaskPool:
    cdef pthread_mutex_t _mutex
    cdef pthread_cond_t _work_cond
    cdef pthread_cond_t _done_cond
    cdef zb_task **_ring
    cdef int64_t _capacity
    cdef int64_t _head        # next task to take
    cdef int64_t _count       # slots in use (claimed slots are NULL until a worker passes them)
    cdef int _stop
    cdef int _running         # workers inside work()
    cdef bint _initialized
    cdef int _num_threads
    cdef int _users           # passes using the threads (attach / detach)
    cdef readonly object threads
    cdef readonly str name
    cdef object __weakref__

    cdef zb_task *_claim_locked(self, zb_task *want) noexcept nogil
    # Queue `task` (blocking, GIL released, while the ring is full); starts the threads.
    cdef int submit(self, zb_task *task) except -1
    # Return once `task` has run: run it here if it is still queued (unless not `claim`), else
    # sleep until done.
    cdef int wait(self, zb_task *task, bint claim=*) except -1
    # Drop `task` if no one has started it (True); else, with `block`, wait for it (False).
    cdef bint cancel(self, zb_task *task, bint block=*) except -1

cdef class Call:
    cdef zb_task task
    cdef object fn
    cdef object result
    cdef object error
    cdef TaskPool pool
    cdef bint finished
    cdef bint caller_runs

# A batch split over a pool: part p of n items cut into `parts` runs as even as can be (the
# first n % parts runs hold one item more), parts in order.
cdef inline int64_t zb_part_len(int64_t n, int64_t parts, int64_t p) noexcept nogil:
    return n // parts + (1 if p < n % parts else 0)

# Room for the parts of one batch: `parts` tasks, then (at *jobs) `parts` jobs of `job_size`
# bytes each, the caller's job type, 16-byte aligned; one block, freed with PyMem_Free(tasks).
cdef zb_task *zb_parts_new(int64_t parts, size_t job_size, void **jobs) except NULL

# Run tasks[0], ..., tasks[n - 1] (n >= 1) as the parts of one batch: all but the last queued
# on `pool` (may be None when n == 1), the last run here with the GIL released, then each
# queued one waited for (run here if no worker has started it).
# post: every task ran, its code in tasks[k].status (the caller maps them). If queueing
#       raises, the tasks already queued have finished before the exception propagates.
cdef int zb_run_parts(TaskPool pool, zb_task *tasks, int64_t n) except -1
