"""A real-text task: byte-level language modelling of the standard library's own Python sources.

The text is a fixed list of pure-Python modules that CPython 3.11, 3.12 and 3.13 all ship with
the same bytes (``SOURCES``), each pinned by its size and SHA-256 and read as bytes from the
running interpreter's standard library: nothing to download, and the same 656 KB on every
supported Python. A listed file that is missing (slim installs) or whose contents differ (a
later patch release) is skipped and named (``TextTask.skipped``, ``TextTask.describe()``); when
less than half of the listed bytes remain, or a split loses all its files, loading fails
instead of training on text that differs from everyone else's. ``TextTask.corpus_sha256`` is
the SHA-256 of the token stream a task reads (training files, then validation files), printed
by ``describe()``: equal to ``CORPUS_SHA256`` wherever nothing was skipped, so a run says which
text it trained on.

Tokens are bytes (vocabulary 256). The split is by file and fixed by the list: every 8th file,
from the 7th on (``abc.py``, ``email/contentmanager.py``, ``multiprocessing/heap.py``,
``string.py``, ``wsgiref/headers.py``, ``zoneinfo/_zoneinfo.py``; about 11% of the bytes) is
validation text, never inside a training window. A window never crosses from one file into
the next.
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

# (path under the standard library, size in bytes, SHA-256 of the bytes): every pure-Python
# module over 4 KB that CPython 3.11, 3.12 and 3.13 all ship with the same bytes (compared on
# 3.11.7, 3.12.1 and 3.13.0), so that every supported Python trains on the same text.
SOURCES: tuple[tuple[str, int, str], ...] = (
    ("__future__.py", 5218, "981d4c398849f9ebcab72300d9c1fe288fd6d7f28957b3b3fa3a493a5836d95c"),
    ("_compression.py", 5681, "3ad5d60627477a60939ee44fc1bb3a05dbe8fb52f0f75039b8f5d8f1a278b981"),
    ("_markupbase.py", 14653, "cb14dd6f2e2439eb70b806cd49d19911363d424c2b6b9f4b73c9c08022d47030"),
    ("_py_abc.py", 6189, "f9c6fe3dd9b51bd7d93f867356e9d362600c924febfd903ee1c6e298860dca92"),
    ("_threading_local.py", 7220, "e1bf3dae66d0bfa63c8bb8a1d10c611203c35c636f7f5191fd56105788ef29cb"),
    ("_weakrefset.py", 5893, "91895a451d06e9f521a1171b31b9b19bc9740f35af00d4fa106338ab7167c9ac"),
    ("abc.py", 6538, "e558702a95cdce3febd289da021715d2b92bc43995b8a1bc58dfa1c3d8010287"),  # validation
    ("asyncio/protocols.py", 6957, "1d1b49988c338b4ef06e30f9e92d9db2e00080c341f0a3f573bb8312deb8aff6"),
    ("asyncio/windows_utils.py", 5060, "e6fcffefa2521666bc2aed0f5caf8e862c1c1014ad12d2ab5fbce09c2df9c6f0"),
    ("concurrent/futures/_base.py", 22833, "8c6d5f09f7c535d40fa1c30ebfcb35e0601c2abf32286a82cf151af7ddf72473"),
    ("ctypes/macholib/dyld.py", 5024, "eb8e7b17f1533bc3e86e23e8695f7a5e4b7a99ef1b1575d10af54f389161b655"),
    ("curses/has_key.py", 5634, "15a052812d9ae80124bb25b3f5b9ffae38e2b03073774e163abf3d773140cfb3"),
    ("difflib.py", 83308, "0c6afc23568d55b3e9ac914f9c5361e3033e778aa5b58d3cc82835fc5c638679"),
    ("email/_encoded_words.py", 8541, "4178321600c0a19ca04cfe8542ce44487f339d15d89a473b58cea63c0b230217"),
    (
        "email/contentmanager.py",
        10588,
        "2d81026aef17e4786b15d9ec0629304987e3f275a0fd0a421a81b4ed87234b2c",
    ),  # validation
    ("email/header.py", 24092, "4d9baa908ad5288dd8fad8cf20b3802ffac77ba1642727804a633b201c56e5ca"),
    ("email/headerregistry.py", 20819, "fada56c25b6a457c6a62af43f9f929bbc29424103ce65f40f114adb4fdf3d39f"),
    ("email/quoprimime.py", 9864, "77b454bd3ba3b5e3776be28ae3a0fd8de5d1e50d5b8ee10dd539c37c2bd68082"),
    ("graphlib.py", 9656, "7bd338c5a475d1101064603d3baa5507446d3c5e73f741f6d6e77c6204c1eb65"),
    ("heapq.py", 23024, "6d43277e5c76fc0f073cd388fcff852d14d068f6bb6d4886c340f8b75a1229a9"),
    ("html/__init__.py", 4775, "923d82d821e75e8d235392c10c145ab8587927b3faf9c952bbd48081eebd8522"),
    ("json/__init__.py", 14020, "d5d41e2c29049515d295d81a6d40b4890fbec8d8482cfb401630f8ef2f77e4d5"),
    (
        "multiprocessing/heap.py",
        11626,
        "f6bb79bb99b9ae484935f0d68822e9603a1622dd0b6c4966c79db232a93ba614",
    ),  # validation
    ("multiprocessing/reduction.py", 9512, "4999f8b9ae7b3e8a7f5de302612b4131498dc2e238a2c47f894905c1c63294fe"),
    ("multiprocessing/sharedctypes.py", 6306, "77ef522912474652490b7df523112858e51721e63dcf109b8567a35ce9b31b0d"),
    ("multiprocessing/spawn.py", 9644, "ebf9fa40eb622384c37690d8c78e7208744df031155ab4ceedab0fc791a1669b"),
    ("multiprocessing/synchronize.py", 12285, "9afc08f6d99deb0cefcbe2f0302dadf3942114aa5564afa0b41bc69f54d1ecaf"),
    ("optparse.py", 60369, "07d224301cba312fa0697bff9cd5a4bb4f778a90629632091b3f4ae874d89af5"),
    ("py_compile.py", 7837, "3464f04938b57a7aafbc5c394ccd4c46823ee607f7fe36b48b91ecbc30ff4e48"),
    ("pyclbr.py", 11396, "e8ca09333701ba41244e20b8c2c37b7ed0499b88c4b2ca82cac51ef89ca9e647"),
    ("string.py", 11786, "24aeae1f0526250f442022022bf98df9a823b1cb330543ee79e70e44907462e9"),  # validation
    ("stringprep.py", 12917, "60b6c83581093029312efb6670b11c540090b3f78bcf72264467b494f02f21a5"),
    ("tomllib/_parser.py", 22631, "4579b04a7566452304781ccce37d3ebc1c36e810b058bdb1f33c0e51ddab0397"),
    ("tracemalloc.py", 18047, "c2cc84a05b824df79840c98729a0e94ef8909b11c528a1b2c5a00aa436b97b25"),
    ("unittest/suite.py", 13512, "ed2da92bc9f97c53403ee2d3d12cc53b16a96e85d596ebc887b5a93458f3f6bc"),
    ("unittest/util.py", 5215, "fdcc640c3505d16deab9c32eae7c3f5f67c3b5e81c563dc6698fa7fcf403854d"),
    ("urllib/robotparser.py", 9424, "389b811835f9a3ba72b192c3487b0266fa31f6e571b7a83ceb2a34792dc0d9fc"),
    ("weakref.py", 21513, "56f8d313fb74019e53eb9287400702fbce788b7fe30e097b0b6e06296f3f080c"),
    ("wsgiref/headers.py", 6766, "0fbf95a47d8e4c0d831fd52312ec43076cbf503c190269876f170a5cf5585fb9"),  # validation
    ("xml/dom/__init__.py", 4019, "b415a6f3d3663c3ac332ee4a0f4213eadad9281508dc97410e258a03633b063a"),
    ("xml/dom/pulldom.py", 11637, "614b88673d496a360e6b10efe8d733c7c0826fb214470ff12f24a1e597699870"),
    ("xml/dom/xmlbuilder.py", 12387, "d4f33a8f018755626b64557953a91c6bba21ff613da46f7558a2874aa5d08ebf"),
    ("xml/etree/ElementPath.py", 13997, "ae8a80a8b51567b4f0965481682705e70c73dd6bfa145283f630d6833f1b4975"),
    ("xml/sax/handler.py", 15617, "64c7aae49f1dd382a7b9012610307bfa1d43a14a5dc09a5c8da30903f6805c3d"),
    ("xml/sax/saxutils.py", 12255, "3fe2cdb6386e0c4d42d37c657bbecb78b69c57aedb1610dbd8bf4043944130ab"),
    ("zoneinfo/_common.py", 5294, "67deaf0ba41aa4865e007297677207485a89b75629eea0ee5c472be8a3e83bf6"),
    ("zoneinfo/_zoneinfo.py", 24674, "ebb9b679519a23252eb90541003a2fdbb3f2d7bc36713fd70672baa575dcdcb6"),  # validation
)

# SHA-256 of the token stream of SOURCES read with nothing skipped: the training files' bytes in
# list order, then the validation files' (the same on 3.11, 3.12 and 3.13).
CORPUS_SHA256 = "00d2ca8f0ca9fbbd28c924a75fe7815632648d481b732a6863567f7178c85697"

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
    def corpus_sha256(self) -> str:
        """SHA-256 (hex) of the text this task reads: the training files' bytes, then the
        validation files'. ``CORPUS_SHA256`` wherever no listed file was skipped."""
        digest = hashlib.sha256(self.train.data)
        digest.update(self.validation.data)
        return digest.hexdigest()

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
        """One line: the text used, its split, what was skipped, and its hash.

        Returns:
          A string naming the number of source files and bytes read, the files and bytes held out
          for validation, the skipped files with the reason for each, and the first 16 hex
          digits of ``corpus_sha256`` with whether it is the pinned text (``CORPUS_SHA256``).
        """
        used = len(self.train) + len(self.validation)
        skipped = "; ".join(f"{name} ({why})" for name, why in self.skipped)
        pinned = "the pinned text" if self.corpus_sha256 == CORPUS_SHA256 else "NOT the pinned text"
        return (
            f"byte-level LM on {len(self.files)} standard-library sources ({used:,} bytes, "
            f"{len(self.validation.files)} files / {len(self.validation):,} bytes held out for validation; "
            f"{len(self.skipped)} skipped{': ' + skipped if skipped else ''}; "
            f"sha256 {self.corpus_sha256[:16]}, {pinned})"
        )
