"""The one base of every failure the code knows how to explain.

A `VrlError`'s message is one line that names the object, file or flag at fault and, where
there is one, what to do. The CLI prints it as `error: <message>` and exits 1 (cli/errors.py,
the only place that maps errors to messages); any other exception is a bug and keeps its
traceback. Each room defines its own subclasses next to the code that raises them
(StorageError, ManifestError, CheckpointError, ...), so catching a room's failures needs no
import of this module, and catching all known ones needs nothing else.
"""

from __future__ import annotations


class VrlError(Exception):
    """A known failure, with a one-line message naming what is at fault."""


class ConfigError(VrlError, ValueError):
    """A setting is out of range or names something that does not exist; the message names the
    setting the way the user spelled it (`--max-staleness`, `model`)."""
