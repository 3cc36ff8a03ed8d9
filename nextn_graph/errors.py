"""Errors the library raises on bad input. Each message names the file, key or value."""

import re
import reprlib

# a filesystem path: two or more components after a root or a drive (``/a/b``, ``C:\\a\\b``)
_PATH = re.compile(r"(?<![\w.:/\\])(?:[A-Za-z]:)?(?:[/\\][\w.+~@-]+){2,}[/\\]?")


def show_value(value: object, limit: int = 80) -> str:
    """A rejected value for an error message, cut short: a message never grows
    with the input (a long list or string prints its head and ``...``)."""
    short = reprlib.Repr()
    short.maxlevel, short.maxstring, short.maxother = 3, limit, limit
    short.maxlist = short.maxtuple = short.maxdict = short.maxset = 8
    text = short.repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def without_paths(text: str) -> str:
    """``text`` for a client: filesystem paths (a kernel's source file, a checkpoint's
    directory) replaced by ``<path>``; the server's log keeps the whole text."""
    return _PATH.sub("<path>", text)


class NextnGraphError(Exception):
    """Base class: every user-facing error of the library."""


class ConfigError(NextnGraphError):
    """A config.json or YAML value is missing, unknown or out of range."""


class CheckpointError(NextnGraphError):
    """A checkpoint tensor is missing, unexpected, or of the wrong shape."""


class InputError(NextnGraphError):
    """A prompt or request is malformed (empty, too long, token out of vocabulary).

    ``field``: the argument at fault (``"max_new_tokens"``, ``"top_p"``, ...) as data, so
    a caller maps it without reading the message; None when no single field is.
    """

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field

    def __reduce__(self):  # (pickled across a process boundary with its field)
        return type(self), (*self.args, self.field)


class CapacityError(NextnGraphError):
    """The KV pool cannot hold what was asked of it."""


class ParallelError(NextnGraphError):
    """A tensor-parallel launch or group failed: a rank died, timed out or disagreed."""


class CaptureError(NextnGraphError):
    """Something inside a captured region cannot live in a static graph."""


class RequestFailed(NextnGraphError):
    """A fault inside a step (a kernel error, out of memory) failed these requests.

    Every other request was left untouched or committed normally; ``errors`` maps
    each failed request (by prompt index, from ``generate``) to its reason;
    ``result`` holds what completed.
    """

    def __init__(self, message: str, errors: dict[int, str], result=None):
        super().__init__(message)
        self.errors = errors
        self.result = result
