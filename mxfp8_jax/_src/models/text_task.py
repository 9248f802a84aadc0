"""A real-text task: byte-level language modelling of the standard library's own Python sources.

The text is a fixed list of pure-Python modules that CPython 3.11 ships (``SOURCES``), each
pinned by its size and SHA-256 and read as bytes from the running interpreter's standard
library: nothing to download, and the same bytes on every install whose files match. A listed
file that is missing (slim installs) or whose contents differ (another CPython release) is
skipped and named (``TextTask.skipped``, ``TextTask.describe()``); when less than half of the
listed bytes remain, or a split loses all its files, loading fails instead of training on text
that differs from everyone else's.

Tokens are bytes (vocabulary 256). The split is by file and fixed by the list: every 8th file,
from the 7th on (``cmd.py``, ``glob.py``, ``optparse.py``, ``tabnanny.py``; about 11% of the
bytes) is validation text, never inside a training window. A window never crosses from one file
into the next.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import numbers
import os
import sysconfig
from collections.abc import Iterator

import numpy as np

from mxfp8_jax._src.core import checks

# (path under the standard library, size in bytes, SHA-256 of the bytes), as CPython 3.11 ships
# them: medium-size modules that are the same in 3.11.2 and 3.11.7, all but two of them the same
# in 3.10, 3.12 or 3.13 as well.
SOURCES: tuple[tuple[str, int, str], ...] = (
    ("_markupbase.py", 14653, "cb14dd6f2e2439eb70b806cd49d19911363d424c2b6b9f4b73c9c08022d47030"),
    ("_osx_support.py", 21787, "6a99e8c9ff67c891a3c4c19e449fe2ee7b9d8e4b71f8741c3ce4469ce315dd95"),
    ("_strptime.py", 25277, "065e6597af214f795d16c018fdfe60ec93ab1d2703bdb159e0576173a19a72f8"),
    ("aifc.py", 34211, "e027e8a33567890ad7f84fea3be423cc0f6e49a33a31bbf279c2d0f64b6f8345"),
    ("bz2.py", 11847, "76ab3252924e71e859d7d90e8d3db13b6554975cfcac0fdadced4de7f8779330"),
    ("cgi.py", 34420, "f132666784c29a3e275f50596f87bb8abc388a94fcdb70be130000e01a9a6b78"),
    ("cmd.py", 14873, "fb82a8c4e44e5b559c88d516d79051534cec69a463df97defe05ac8a261f0a0d"),  # validation
    ("code.py", 10622, "266841655656d5b2370e80addcdb959f5173142d5e3778b489e734802447c5e8"),
    ("concurrent/futures/_base.py", 22833, "8c6d5f09f7c535d40fa1c30ebfcb35e0601c2abf32286a82cf151af7ddf72473"),
    ("copy.py", 8681, "27dcfc53a4b9d4fbc3d90c74e549eb6eca9301524d6d2fbff9a6589cf51b6fd5"),
    ("csv.py", 16030, "6c68a5186e3b85e6e267a7ef96479327a45ae2b40bf5e9f2017e4b2282b3f5b1"),
    ("difflib.py", 83308, "0c6afc23568d55b3e9ac914f9c5361e3033e778aa5b58d3cc82835fc5c638679"),
    ("filecmp.py", 10178, "178f19895fdd43d5d3865b2bfe9ae7b665611a30d29cfc23d44f01417774851c"),
    ("fractions.py", 28667, "b11e850e354808b882d13a70a911c29accd1dbdd41757566704e3b7206c74edb"),
    ("glob.py", 8681, "fa579f8a50a66313d34d339f10be0821c9b4fed6207e8ba8e29ed1c5e119f740"),  # validation
    ("graphlib.py", 9656, "7bd338c5a475d1101064603d3baa5507446d3c5e73f741f6d6e77c6204c1eb65"),
    ("heapq.py", 23024, "6d43277e5c76fc0f073cd388fcff852d14d068f6bb6d4886c340f8b75a1229a9"),
    ("lzma.py", 13277, "58fb9d2fdc8a8af7b25e218f17ea3b51bdfa53bdf40f440ab33c605974ca5c2e"),
    ("mailbox.py", 78794, "e695a76d936f009d926e50eae09e34e1256ceee86ffb5b5825748e98f9080036"),
    ("modulefinder.py", 23699, "e07ab000c3698a7530af2c52955ac8bb7647140d22dca1c30f83443faa191e0f"),
    ("numbers.py", 10348, "6d70991643a109e9c99e94d6ea2734a995fa8e89114a70ea09737413fa9ae292"),
    ("operator.py", 10965, "b2af20f67667203c1730e686cc5d0427becc94db4c97f1d3efe3ed2158473f6a"),
    ("optparse.py", 60369, "07d224301cba312fa0697bff9cd5a4bb4f778a90629632091b3f4ae874d89af5"),  # validation
    ("pickletools.py", 93486, "bcc8d00ebadd684aba19169e853e6f23bc36d609ae0c8119912f1e39e9f0c1e9"),
    ("pprint.py", 24489, "0b67dbc8af449d8ced3acd9df902e98c2dbc56c8f2a7a181c51cc72768db621f"),
    ("pyclbr.py", 11396, "e8ca09333701ba41244e20b8c2c37b7ed0499b88c4b2ca82cac51ef89ca9e647"),
    ("queue.py", 11496, "f6c37fc37cd7440979f7d22d40ee818fa3b714c573610c08fa52911d541193f0"),
    ("shelve.py", 8560, "b978c6f0ffa901b041d6518afed03f2938a62168066013ee7d23baac31c356c0"),
    ("shlex.py", 13501, "42ab6060f316e121e374e6621d8c1c98b8db323903c3df289a810c45a8ae46a7"),
    ("string.py", 11786, "24aeae1f0526250f442022022bf98df9a823b1cb330543ee79e70e44907462e9"),
    ("tabnanny.py", 11299, "73bc1829f10634726db7a22f1cb5c06f76802d54cd7edba0ecff145156caa2f8"),  # validation
    ("telnetlib.py", 23301, "1984cebfb50180759ca075b0ea340d3624500dc22fab524a4dbf57c18bb548ca"),
    ("textwrap.py", 19718, "62867e40cdea6669b361f72af4d7daf0359f207c92cbeddfc7c7506397c1f31c"),
    ("tomllib/_parser.py", 22631, "4579b04a7566452304781ccce37d3ebc1c36e810b058bdb1f33c0e51ddab0397"),
    ("tracemalloc.py", 18047, "c2cc84a05b824df79840c98729a0e94ef8909b11c528a1b2c5a00aa436b97b25"),
    ("weakref.py", 21513, "56f8d313fb74019e53eb9287400702fbce788b7fe30e097b0b6e06296f3f080c"),
    ("xml/sax/handler.py", 15617, "64c7aae49f1dd382a7b9012610307bfa1d43a14a5dc09a5c8da30903f6805c3d"),
)

# File i of SOURCES is validation text when i % VALIDATION_EVERY == VALIDATION_AT.
VALIDATION_EVERY, VALIDATION_AT = 8, 6


def is_validation(index: int) -> bool:
    """Whether the file at ``index`` in ``SOURCES`` belongs to the validation split."""
    return index % VALIDATION_EVERY == VALIDATION_AT


@dataclasses.dataclass(frozen=True, eq=False)
class TextSplit:
    """The files of one split, concatenated in list order: ``data[offsets[i]:offsets[i + 1]]``
    holds the bytes of ``files[i]`` (``data`` uint8 and ``offsets`` int64, both read-only)."""

    files: tuple[str, ...]
    data: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return int(self.data.size)

    def text(self, name: str) -> bytes:
        """The bytes of file ``name`` of this split."""
        if name not in self.files:
            raise ValueError(f"name={name!r} is not a file of this split ({', '.join(self.files)})")
        i = self.files.index(name)
        return self.data[self.offsets[i] : self.offsets[i + 1]].tobytes()

    def windows(self, seq_len: int) -> int:
        """How many ``seq_len``-byte windows lie inside one file: the windows a task draws from."""
        return int(self._counts(seq_len).sum())

    def starts(self, index: np.ndarray, seq_len: int) -> np.ndarray:
        """Window numbers ``index`` (each in ``[0, windows(seq_len))``, numbered file by file)
        -> their first bytes' positions in ``data``."""
        cum = np.concatenate([[0], np.cumsum(self._counts(seq_len))])
        index = np.asarray(index, np.int64)
        file = np.searchsorted(cum, index, side="right") - 1
        return self.offsets[file] + index - cum[file]

    def gather(self, starts: np.ndarray, seq_len: int) -> np.ndarray:
        """The ``seq_len`` bytes from each of ``starts [n]`` -> ``[n, seq_len]`` int32 tokens."""
        return self.data[np.asarray(starts)[:, None] + np.arange(seq_len)].astype(np.int32)

    def _counts(self, seq_len: int) -> np.ndarray:
        return np.maximum(np.diff(self.offsets) - seq_len + 1, 0)


@dataclasses.dataclass(frozen=True, eq=False)
class Corpus:
    """The listed sources as read here: the two splits, the skipped files with the reason for
    each (``"missing"``, ``"unreadable"`` or ``"hash differs"``), and the listed total."""

    train: TextSplit
    validation: TextSplit
    skipped: tuple[tuple[str, str], ...]
    listed_bytes: int


def stdlib_dir() -> str:
    """The running interpreter's standard-library directory."""
    return sysconfig.get_paths()["stdlib"]


def load_corpus() -> Corpus:
    """``SOURCES`` read from this interpreter's standard library (once per process and list).

    Raises RuntimeError, naming the skipped files, when less than half of the listed bytes, or
    no training or no validation file, remain.
    """
    return _load(SOURCES, stdlib_dir())


@functools.lru_cache(maxsize=8)
def _load(sources: tuple[tuple[str, int, str], ...], root: str) -> Corpus:
    found: dict[bool, list[tuple[str, bytes]]] = {False: [], True: []}
    skipped = []
    for i, (name, _, sha256) in enumerate(sources):
        try:
            with open(os.path.join(root, *name.split("/")), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            skipped.append((name, "missing"))
            continue
        except OSError:
            skipped.append((name, "unreadable"))
            continue
        if hashlib.sha256(data).hexdigest() != sha256:
            skipped.append((name, "hash differs"))
            continue
        found[is_validation(i)].append((name, data))
    listed = sum(size for _, size, _ in sources)
    kept = sum(len(data) for files in found.values() for _, data in files)
    problem = None
    if 2 * kept < listed:
        problem = f"only {kept:,} of the {listed:,} listed bytes remain"
    elif not found[False] or not found[True]:
        problem = f"no {'validation' if found[False] else 'training'} file remains"
    if problem:
        names = "; ".join(f"{name} ({why})" for name, why in skipped)
        raise RuntimeError(
            f"the standard-library text of this Python is not the pinned one: {problem} "
            f"(skipped: {names}); its data would differ from every other install's"
        )
    return Corpus(_split(found[False]), _split(found[True]), tuple(skipped), listed)


def _split(files: list[tuple[str, bytes]]) -> TextSplit:
    data = np.frombuffer(b"".join(d for _, d in files), np.uint8)  # read-only: shared by the cache
    offsets = np.concatenate([[0], np.cumsum([len(d) for _, d in files])]).astype(np.int64)
    offsets.setflags(write=False)
    return TextSplit(tuple(name for name, _ in files), data, offsets)


class TextTask:
    """Batches of ``[batch, seq_len]`` int32 byte windows of standard-library Python sources.

    ``batches`` draws windows uniformly at random from every window that lies inside one
    training file, from ``default_rng(seed)``; ``validation_batches`` are evenly spaced windows
    of the validation files, the same for every seed. ``next_token_loss`` on a batch predicts
    ``seq_len - 1`` bytes from the ones before them.

    There is no known best loss; ``unigram_entropy`` (nats/byte) is what a model that ignores
    context achieves on the training text, the mark a model's loss should go below.
    """

    vocab = 256

    def __init__(self, seq_len: int, seed: int = 0) -> None:
        seq_len = checks.positive_int(seq_len, "seq_len")
        if seq_len < 2:
            raise ValueError(f"seq_len={seq_len} must be at least 2 (an input and its next byte)")
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
            raise ValueError(f"seed={seed!r} must be a non-negative int")
        corpus = load_corpus()
        for split, what in ((corpus.train, "training"), (corpus.validation, "validation")):
            if split.windows(seq_len) == 0:
                longest = int(np.diff(split.offsets).max())
                raise ValueError(f"seq_len={seq_len} must be at most {longest:,}, the longest {what} file")
        self.seq_len, self.seed = seq_len, int(seed)
        self.train, self.validation = corpus.train, corpus.validation
        self.skipped, self.listed_bytes = corpus.skipped, corpus.listed_bytes

    @property
    def files(self) -> tuple[str, ...]:
        """Every file read, training files then validation files."""
        return self.train.files + self.validation.files

    @functools.cached_property
    def unigram_entropy(self) -> float:
        """Entropy (nats/byte) of the training bytes' byte distribution: the mean loss of the
        best model that ignores context, between 0 and ``log(256)``."""
        counts = np.bincount(self.train.data, minlength=self.vocab)
        p = counts[counts > 0] / counts.sum()
        return float(-(p * np.log(p)).sum())

    def batches(self, steps: int, batch: int) -> Iterator[np.ndarray]:
        """``steps`` batches of ``batch`` training windows, the same sequence for the same seed.

        Args:
          steps: how many batches, a non-negative int.
          batch: windows per batch, a positive int.

        Returns:
          An iterator of int32 arrays ``[batch, seq_len]`` of byte tokens, each window drawn
          uniformly (with replacement) from the windows inside one training file. The arguments
          are checked when this is called, not when the iterator is first advanced.
        """
        if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 0:
            raise ValueError(f"steps={steps!r} must be a non-negative int")
        batch = checks.positive_int(batch, "batch")
        return self._batches(int(steps), batch)

    def _batches(self, steps: int, batch: int) -> Iterator[np.ndarray]:
        rng = np.random.default_rng(self.seed)
        windows = self.train.windows(self.seq_len)
        for _ in range(steps):
            index = rng.integers(0, windows, batch)
            yield self.train.gather(self.train.starts(index, self.seq_len), self.seq_len)

    def validation_batches(self, batch: int, count: int) -> list[np.ndarray]:
        """``count`` batches of ``batch`` validation windows, evenly spaced over the validation
        files (distinct; independent of the seed).

        Args:
          batch: windows per batch, a positive int.
          count: how many batches, a positive int; ``batch * count`` must be at most the number of
            ``seq_len``-byte windows inside the validation files (else a ValueError).

        Returns:
          A list of ``count`` int32 arrays ``[batch, seq_len]`` of byte tokens.
        """
        batch = checks.positive_int(batch, "batch")
        count = checks.positive_int(count, "count")
        windows, n = self.validation.windows(self.seq_len), batch * count
        if n > windows:
            raise ValueError(
                f"batch * count = {n:,} must be at most {windows:,}, the validation windows of {self.seq_len} bytes"
            )
        starts = self.validation.starts(np.arange(n, dtype=np.int64) * windows // n, self.seq_len)
        tokens = self.validation.gather(starts, self.seq_len)
        return [tokens[i * batch : (i + 1) * batch] for i in range(count)]

    def describe(self) -> str:
        """One line: the text used, its split, and what was skipped.

        Returns:
          A string naming the number of source files and bytes read, the files and bytes held out
          for validation, and the skipped files with the reason for each.
        """
        used = len(self.train) + len(self.validation)
        skipped = "; ".join(f"{name} ({why})" for name, why in self.skipped)
        return (
            f"byte-level LM on {len(self.files)} standard-library sources ({used:,} bytes, "
            f"{len(self.validation.files)} files / {len(self.validation):,} bytes held out for validation; "
            f"{len(self.skipped)} skipped{': ' + skipped if skipped else ''})"
        )
