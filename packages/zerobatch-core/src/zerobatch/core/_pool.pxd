# A pool of worker threads that run C tasks with the GIL released from start to finish.
#
# Python threads enter TaskPool.work(), drop the GIL and loop in C: take a task from a ring,
# run it, mark it done. A thread that waits for a task nobody has started yet runs it itself
# ("caller runs"), so a pool of cores-1 workers plus the waiting thread keeps every core busy
# without oversubscribing them. Neither side touches a Python object while a task runs: the caller
# keeps every object a task points into alive until it has waited for that task.

from libc.stdint cimport int64_t

ctypedef int (*zb_task_fn)(void *arg) noexcept nogil

cdef enum:
    ZB_TASK_QUEUED = 0
    ZB_TASK_RUNNING = 1
    ZB_TASK_DONE = 2

cdef struct zb_task:
    zb_task_fn fn      # the work; returns a zb_status code
    void *arg          # its argument (owned by the submitter)
    int status         # set by whoever ran it
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
    cdef int64_t _count       # tasks queued, not yet taken
    cdef int _stop
    cdef int _running         # workers inside work()
    cdef bint _initialized
    cdef int _num_threads
    cdef readonly object threads
    cdef object __weakref__

    cdef zb_task *_claim_locked(self, zb_task *want) noexcept nogil
    cdef int submit(self, zb_task *task) except -1
    cdef int wait(self, zb_task *task) except -1
    cdef bint cancel(self, zb_task *task) except -1
