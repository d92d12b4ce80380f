"""The bucket: one small interface (read, create-only write, compare-and-swap, list, delete)
and its backends (a local folder, any fsspec filesystem, S3), plus retry as a wrapper.

Knows nothing of what the objects mean; that is protocol's job.

May import: the shared modules (errors, faults) only.
"""
