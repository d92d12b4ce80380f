"""A storage wrapper for tests that must see which calls the code under test makes."""
from collections import Counter


class RecordingStorage:
    """A real storage that records the calls made on it: `calls` counts them by method,
    `lists` holds each listing as (method, prefix, limit, keys returned)."""

    def __init__(self, inner):
        self.inner, self.uri, self.calls, self.lists = inner, inner.uri, Counter(), []

    def __getattr__(self, name):
        fn = getattr(self.inner, name)
        if not callable(fn):
            return fn

        def recorded(*args, **kwargs):
            self.calls[name] += 1
            out = fn(*args, **kwargs)
            if name in ("list", "list_level"):
                limit = args[1] if len(args) > 1 else kwargs.get("limit")
                self.lists.append((name, args[0], limit, len(out)))
            return out
        return recorded
