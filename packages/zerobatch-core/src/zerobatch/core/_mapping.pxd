# A read-only file mapping that holds no descriptor: the memory the kernels read through an
# address. A resource, not a kernel: it owns only its mapping, unmapped when the last view of
# it goes (close() refuses while views are alive).

from libc.stdint cimport int64_t, uint8_t

cdef class FileMapping:
    cdef uint8_t *addr          # the mapping (NULL: empty or closed)
    cdef readonly int64_t size  # bytes mapped
    cdef int exports            # buffers handed out and not yet released
    cdef readonly object path   # the file, named in errors
    cdef void _unmap(self) noexcept
